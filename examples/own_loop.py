"""Your own model, optimizer and training loop, on one process or many: paratrain as a library.

    python examples/own_loop.py                                              # one plain process
    torchrun --standalone --nproc-per-node 2 examples/own_loop.py --zero 3   # 2 ranks, ZeRO-3
    torchrun --standalone --nproc-per-node 2 examples/own_loop.py --zero 2 --offload cpu

Every layout trains the same weights as the one plain process (up to fp32 summation order):
each rank takes its slice of the same global batch, and ``par.backward`` averages the gradients
over the ranks, as PyTorch's DDP does.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

import paratrain


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: the same rows on every rank, whatever the layout."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(size, 16, generator=g)
    return x, (x[:, :4].sum(dim=1) > 0).long() + 2 * (x[:, 4:8].sum(dim=1) > 0).long()  # 4 classes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3 (0: DDP)")
    ap.add_argument("--offload", default="none", choices=["none", "cpu", "disk"])
    ap.add_argument("--offload-dir", default=None)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16, help="global batch (rows over all ranks)")
    ap.add_argument("--save", default=None, help="checkpoint directory (par.save at the end)")
    ap.add_argument("--out", default=None, help="write the final full weights to this .safetensors file")
    args = ap.parse_args()

    par = paratrain.Parallel(zero=args.zero, offload=args.offload, offload_dir=args.offload_dir, timeout=60)

    torch.manual_seed(0)  # rank 0's initial weights are broadcast anyway
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))  # warmup

    model, optimizer = par.prepare(model, optimizer)
    par.register_for_checkpointing(scheduler)

    per_rank = args.batch // par.dp_size
    rows = slice(par.dp_rank * per_rank, (par.dp_rank + 1) * per_rank)
    for step in range(args.steps):
        x, y = batch(step, args.batch)
        loss = F.cross_entropy(model(x[rows].to(par.device)), y[rows].to(par.device))  # this rank's mean
        par.backward(loss)
        norm = par.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if par.is_main:
            print(f"step {step}  loss(rank 0) {loss.item():.4f}  grad norm {norm.item():.4f}")

    state = par.full_state_dict(model)  # every rank calls it: full tensors, the model's own names
    if args.save:
        par.save(args.save)
    if par.is_main and args.out:
        save_file({k: v.contiguous() for k, v in state.items()}, args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
