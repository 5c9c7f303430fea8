"""Activation checkpointing: keep a region's inputs, recompute its inside during backward.

Two policies (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models"), small classes with ``.apply(model)``, chosen from the ``POLICIES`` table:

* ``full``: every transformer block keeps only its input; the whole block runs again in backward
  (about +33% compute, activations drop to ``seq * batch * dim`` per block).
* ``selective``: only the core attention (``attn.core``: grouped-query repeat + softmax(qk^T)v)
  is recomputed. Its inputs q, k, v are kept (k, v before the grouped-query repeat); its output
  and the log-sum-exp are not. The recomputed part is a small share of the FLOPs, which is the
  paper's point: most of the memory of attention for little of its compute. With a fused
  attention kernel (no s x s scores stored) the saving is smaller than the paper's 5as/h term.

Both wrap ``forward`` in place instead of inserting a module, so parameter names (checkpoints,
exports, tensor-parallel plans) stay exactly those of the single-device model.

A layer whose forward has a side effect besides its output (a mixture-of-experts layer records
its auxiliary losses for the loss to take) asks ``recomputing()``: the re-run in backward must
not replace what the first forward recorded (the loss already holds it) nor add it again.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from paratrain.base.weight_grad import recapture
from paratrain.models.registry import family_of
from paratrain.models.rerun import recompute_context as _recompute_context

# The recomputation runs in whichever thread executes the backward (the autograd engine's
# device thread on CUDA): a thread-local flag set by checkpoint's recompute context there.


def _contexts():
    """checkpoint's context_fn: nothing around the first forward; around the re-run the flag, and
    a zero-bubble B's capture of the linears (base/weight_grad.py: the re-run builds the same graph)."""
    return contextlib.nullcontext(), _rerun()


@contextlib.contextmanager
def _rerun():
    with _recompute_context(), recapture():  # recapture() asks at the re-run, inside B
        yield


class Recompute:
    """Checkpoint, in every block, the submodule the model family declares for this policy."""

    policy = ""
    traced_plain = False  # the region may be checkpointed without contexts when compiled (above)

    def apply(self, model: nn.Module) -> nn.Module:
        family = family_of(model, f"--recompute {self.policy} (its targets)")
        target = family.recompute[self.policy]
        for block in family.blocks_of(model).values():
            region = block.get_submodule(target) if target else block
            region.forward = _checkpointed_forward(region.forward, self.traced_plain)
        return model


class FullRecompute(Recompute):
    """Recompute every transformer block (Megatron's "full" recomputation)."""

    policy = "full"


class SelectiveRecompute(Recompute):
    """Recompute the core attention of every block (Megatron's "selective" recomputation)."""

    policy = "selective"
    traced_plain = True  # softmax(qk^T)v records nothing; a compiled block traces it (--compile)


POLICIES: dict[str, type | None] = {"none": None, "full": FullRecompute, "selective": SelectiveRecompute}


def apply_recompute(model: nn.Module, policy: str) -> nn.Module:
    """Apply the named policy (``none`` leaves the model as it is)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown recompute policy {policy!r}; choose one of {', '.join(POLICIES)}")
    cls = POLICIES[policy]
    return cls().apply(model) if cls is not None else model


def _checkpointed_forward(forward, traced_plain: bool = False):
    """``forward`` checkpointed. ``traced_plain``: inside a torch.compile'd block, checkpoint it
    without the contexts: dynamo traces a checkpoint only with a context_fn of dispatch modes (ours
    are plain context managers, and the trace fails), and the region then needs neither context
    (a region with no side effect for the flag to guard; no zero-bubble B runs compiled blocks)."""
    def run(*args, **kwargs):  # keywords too: attention's core takes positions by name
        if traced_plain and torch.compiler.is_compiling():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        if torch.compiler.is_compiling():  # a region with side effects (a MoE layer records its losses)
            return _eager_checkpoint(forward, *args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=_contexts, **kwargs)

    return run


@torch.compiler.disable
def _eager_checkpoint(forward, *args, **kwargs):
    """A checkpoint the compiled block calls eagerly, with its contexts: dynamo refuses the contexts
    (above), and the re-run needs the flag. --recompute full checkpoints the whole block, so a
    compiled block runs eager (what a graph break inside the region, e.g. a TP collective, did already)."""
    return checkpoint(forward, *args, use_reentrant=False, context_fn=_contexts, **kwargs)
