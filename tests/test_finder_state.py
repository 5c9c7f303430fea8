"""Every parameter and buffer in the library's checkpoints and full state dicts, in every ZeRO stage
(issue 23, items 6 and 7).

ZeRO-1/2 hold the trainable parameters in flat shards; the frozen ones (``requires_grad=False``,
e.g. a LoRA model's base) sit in no shard and were left out of ``state_pieces``: ``save`` dropped
them, ``load`` left them at a fresh model's values and ``full_state_dict`` returned fewer keys than
under ZeRO-0. A model with half its parameters frozen is trained, saved and loaded into one built
from another seed; every tensor must come back. ZeRO-3 holds the frozen parameters sharded, in flat
buffers of their own beside the trainable ones (issue 24): the same check.
"""
from __future__ import annotations

import torch
import torch.nn as nn

import paratrain
from tests.dist import run

DIM = 8


class Adapted(nn.Module):
    """A frozen base (linears, a norm) with a small trainable adapter beside each linear, and a
    persistent buffer."""

    def __init__(self):
        super().__init__()
        self.base = nn.ModuleList([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)])
        self.norm = nn.LayerNorm(DIM)
        self.adapters = nn.ModuleList([nn.Linear(DIM, 2, bias=False), nn.Linear(2, DIM, bias=False)])
        self.register_buffer("offset", torch.zeros(DIM))

    def forward(self, x):
        for lin in self.base:
            x = torch.tanh(lin(x) + self.adapters[1](self.adapters[0](x)))
        return self.norm(x) + self.offset


def build(seed: int, freeze: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Adapted()
    with torch.no_grad():  # every tensor differs between seeds (LayerNorm starts at ones/zeros)
        for t in [*model.parameters(), model.offset]:
            t.normal_()
    if freeze:
        for p in [*model.base.parameters(), *model.norm.parameters()]:
            p.requires_grad_(False)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _round_trip(env, folder: str) -> dict:
    """Per stage: (keys of the model's own state_dict, full_state_dict after training,
    full_state_dict of a model of another seed after load)."""
    out = {}
    for zero in range(4):
        par = paratrain.Parallel(zero=zero, timeout=60)
        model, opt = build(0, True)
        keys = sorted(model.state_dict())
        model, opt = par.prepare(model, opt)
        g = torch.Generator().manual_seed(10 + par.rank)
        for _ in range(2):
            loss = model(torch.randn(4, DIM, generator=g)).square().mean()
            par.backward(loss)
            opt.step()
            opt.zero_grad()
        saved = par.full_state_dict(model)
        par.save(f"{folder}/zero{zero}")
        fresh = paratrain.Parallel(zero=zero, timeout=60)
        model2, opt2 = fresh.prepare(*build(1, True))
        fresh.load(f"{folder}/zero{zero}")
        out[zero] = (keys, saved, fresh.full_state_dict(model2))
    return out


def test_frozen_parameters_survive_save_and_load_in_every_stage(tmp_path):
    got = run(_round_trip, 2, str(tmp_path), timeout=180)[0]
    other_seed = build(1, True)[0].state_dict()
    for zero, (keys, saved, loaded) in got.items():  # the same keys in every layout: the model's own
        assert sorted(saved) == keys, f"zero {zero}: full_state_dict keys {sorted(saved)} != {keys}"
        assert sorted(loaded) == keys, f"zero {zero}: after load {sorted(loaded)} != {keys}"
        for name in keys:
            assert torch.equal(loaded[name], saved[name]), f"zero {zero}: {name} not restored"
            assert not torch.equal(saved[name], other_seed[name]), f"{name}: the seeds must differ"
