"""Numerics guards: a non-finite loss or gradient norm (outside the fp16 scaler, which handles its own)
stops the run before anything is saved, or skips the step, as ``--nan-policy`` says."""

from __future__ import annotations

import torch

NAN_POLICIES = ("stop", "skip")


class NumericsError(RuntimeError):
    """Training diverged: the message names the step and the first non-finite tensor."""


def first_non_finite(model: torch.nn.Module) -> str | None:
    """Name of this rank's first parameter whose gradient (or value) is not finite."""
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            return f"{name} (the weights themselves)"
        if p.grad is not None and not torch.isfinite(p.grad).all():
            return f"{name} (its gradient)"
    return None


def non_finite_step(step: int, norm: float, policy: str, model: torch.nn.Module) -> bool:
    """The global gradient norm (the same on every rank) is not finite: return True to skip the
    optimizer step (policy "skip") or raise NumericsError (policy "stop") before anything is saved,
    so the checkpoints on disk stay the last good ones."""
    if policy == "skip":
        return True
    where = first_non_finite(model) or "none on this rank (the gradients are sharded elsewhere)"
    raise NumericsError(
        f"step {step + 1}: the loss or gradient norm is not finite (grad norm {norm}); first "
        f"non-finite tensor: {where}. Lower --lr, raise --warmup-steps, set --grad-clip, or "
        f"pass --nan-policy skip to skip such steps; the checkpoints on disk are from before it")
