"""The trainer's side of the mixture of experts: the auxiliary losses added to the loss sum, the
metrics rows, and the configuration checks (the model itself is models/moe.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

from paratrain.models.llama import LlamaConfig
from paratrain.models.moe import moe_layers, moe_loss_sum, moe_metrics


class MoEAccounting:
    """Adds the MoE layers' aux and z losses of the forward just run to the cross-entropy sum.

    Both are token-unit sums (models/moe.py says why per row), so the executor's division by the
    global token count gives the one-process mean whatever dp and the micro-batching are."""

    def __init__(self, model: nn.Module, cfg: LlamaConfig):
        self.model, self.cfg = model, cfg

    def add_aux(self, ce_sum: torch.Tensor) -> torch.Tensor:
        aux = moe_loss_sum(self.model, aux_loss_coef=self.cfg.aux_loss_coef, z_loss_coef=self.cfg.z_loss_coef,
                           n_moe_layers=self.cfg.n_moe_layers)
        for layer in moe_layers(self.model):  # the loss holds the graph; the layers need not
            if layer.stats is not None:
                _detach(layer.stats)
        return ce_sum if aux is None else ce_sum + aux

    def metrics(self) -> dict:
        """This rank's last micro-batch (rank 0 writes the row): unweighted means per token."""
        stats = [m.stats for m in moe_layers(self.model) if m.stats is not None]
        n_tokens = stats[0].assigned // self.cfg.top_k if stats else 1
        return moe_metrics(self.model, n_tokens=n_tokens)


def _detach(stats) -> None:
    stats.aux_sum, stats.z_sum = stats.aux_sum.detach(), stats.z_sum.detach()


# Compositions not built yet for MoE models: refused before workers start, with the fix.
NOT_WITH_MOE = {
    "tp": (lambda c: c.parallel.tp > 1, "remove --tp (experts are not tensor-parallel yet)"),
    "pp": (lambda c: c.parallel.pp > 1, "remove --pp (pipeline stages do not carry the aux loss yet)"),
    "tile": (lambda c: c.train.tile > 1, "use --tile 1 (tiling replaces the dense MLP)"),
    "recompute": (lambda c: c.train.recompute != "none", "use --recompute none"),
}


# Expert parallelism composes with DDP, plain DP and ZeRO-1/2/3 (expert_parallel/); not yet with these.
NOT_WITH_EP = {
    "--tp": (lambda c: c.parallel.tp > 1, "use --tp 1 with --ep, or --ep 1 with --tp"),
    "--pp": (lambda c: c.parallel.pp > 1, "use --pp 1 with --ep, or --ep 1 with --pp"),
}


def check_moe(cfg, problems: list[str]) -> None:
    """MoE settings and the layouts that cannot hold them (called by parallelize.check_layout)."""
    from paratrain.train.task import model_shape

    ep = cfg.parallel.ep
    dense_ep = (f"--ep {ep} spreads the experts of a mixture-of-experts model; this model is dense: "
                "drop --ep, or give it experts (--experts N, or a -moe preset)")
    if cfg.model.name == "cnn-tiny":
        if ep > 1:
            problems.append(dense_ep)
        return
    try:
        c = model_shape(cfg)
    except (KeyError, OSError, ValueError):
        return  # an unknown model or folder is reported elsewhere
    if c.n_experts < 0:
        problems.append(f"--experts must be >= 0 (got {c.n_experts}); 0 is the dense model")
    if c.n_experts <= 0:
        if ep > 1:
            problems.append(dense_ep)
        return
    if not 1 <= c.top_k <= c.n_experts:
        problems.append(f"--top-k ({c.top_k}) must be between 1 and the number of experts ({c.n_experts})")
    if c.capacity_factor < 0:
        problems.append(f"--capacity-factor must be >= 0 (got {c.capacity_factor}); 0 is dropless")
    for name in ("aux_loss_coef", "z_loss_coef"):
        if getattr(c, name) < 0:
            problems.append(f"--{name.replace('_', '-')} must be >= 0 (got {getattr(c, name)})")
    if ep > 1 and cfg.dp % ep:
        problems.append(f"--ep ({ep}) must divide the data-parallel degree ({cfg.dp}): change --ep or --dp")
    if ep > 1 and c.n_experts % ep:
        problems.append(f"--ep ({ep}) must divide the number of experts ({c.n_experts}): "
                        "change --ep or --experts")
    for name, (used, fix) in NOT_WITH_MOE.items():
        if used(cfg):
            problems.append(f"{name} with a mixture-of-experts model is not supported yet: {fix}")
    for name, (used, fix) in NOT_WITH_EP.items():
        if ep > 1 and used(cfg):
            problems.append(f"--ep with {name} is not built yet: {fix}")
