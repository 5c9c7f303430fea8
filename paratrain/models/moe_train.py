"""The trainer's side of the mixture of experts: the auxiliary losses added to the loss sum, the
metrics rows (the model itself is models/moe.py; the configuration checks are engine/checks.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

from paratrain.models.moe import moe_layers, moe_loss_sum
from paratrain.models.shape import ModelShape


class MoEAccounting:
    """The MoE layers' aux and z losses of the forward just run, for the executor to add to the loss.

    Both are token-unit sums (models/moe.py says why per row), so the executor's division by the
    global token count gives the one-process mean whatever dp and the micro-batching are. The
    executor asks right after each forward, for the modules that forward ran (the whole model, or
    one pipeline stage's chunk): each stage's losses then enter that stage's own backward."""

    def __init__(self, model: nn.Module, cfg: ModelShape):
        self.model, self.cfg = model, cfg
        self.last: dict[int, dict] = {}  # id(layer) -> figures of its last training forward
        self.step_sum = 0.0  # this rank's aux + z loss sums of the training forwards since taken

    def side_loss_sum(self, modules: list[nn.Module], train: bool = True) -> torch.Tensor | None:
        layers = [m for module in modules for m in moe_layers(module) if m.stats is not None]
        if not layers:
            return None
        aux = moe_loss_sum(layers, aux_loss_coef=self.cfg.aux_loss_coef, z_loss_coef=self.cfg.z_loss_coef,
                           n_moe_layers=self.cfg.n_moe_layers)
        for layer in layers:  # taken: the loss holds the graph now, the layer need not
            if train:
                self.last[id(layer)] = _figures(layer.stats)
            layer.stats = None
        if train:
            self.step_sum += float(aux.detach())
        return aux

    def take_step_sum(self) -> float:
        """The aux + z loss sums (loss-sum units) added to the training losses since the last call."""
        out, self.step_sum = self.step_sum, 0.0
        return out

    def metric_parts(self) -> list[dict]:
        """This rank's MoE layers, each as of its last training forward (a micro-batch)."""
        return list(self.last.values())

    def metrics(self, parts: list[dict] | None = None) -> dict:
        """moe_* of the metrics row from ``parts`` (default: this rank's layers; a pipeline
        gathers every stage's)."""
        return combine_figures(self.metric_parts() if parts is None else parts, self.cfg.top_k)


def _figures(stats) -> dict:
    return {"aux_sum": float(stats.aux_sum.detach()), "z_sum": float(stats.z_sum.detach()),
            "assigned": stats.assigned, "dropped": stats.dropped, "load": stats.load.tolist()}


def combine_figures(parts: list[dict], top_k: int) -> dict:
    """Per-token aux and z (means over layers), dropped fraction, expert load (fraction of
    assignments per expert, mean over layers)."""
    if not parts:
        return {}
    n = len(parts)
    load = torch.tensor([p["load"] for p in parts], dtype=torch.float64)
    assigned = torch.tensor([p["assigned"] for p in parts], dtype=torch.float64)
    per_layer = load / assigned.unsqueeze(-1)
    return {"moe_aux_loss": sum(p["aux_sum"] / (p["assigned"] / top_k) for p in parts) / n,
            "moe_z_loss": sum(p["z_sum"] / (p["assigned"] / top_k) for p in parts) / n,
            "moe_dropped_fraction": sum(p["dropped"] for p in parts) / float(assigned.sum()),
            "moe_expert_load": [round(v, 6) for v in per_layer.mean(0).tolist()]}


# Compositions not built for MoE models: refused before workers start, with the fix. EP, TP, SP,
# PP, ZeRO and recompute compose, EP with each of the others too (docs/moe.md).
