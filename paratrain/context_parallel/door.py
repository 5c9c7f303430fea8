"""Context parallelism for a module paratrain does not know: the library door (docs/context_parallel.md).

A paratrain model family declares its attention core and apply.py swaps it. A user's own module
or a transformers model declares nothing, so its attention is routed where every modern model
sends it:

* a transformers model (``transformers.PreTrainedModel``): an attention function registered in
  transformers' ``AttentionInterface`` and named in ``model.config._attn_implementation``; every
  attention layer then calls it with q/k/v of this rank's positions, and it calls cp_attention.
  The model's own mask is not built (the name has no mask function: transformers skips it), the
  positions make the mask instead;
* any other module: ``torch.nn.functional.scaled_dot_product_attention`` is intercepted by a
  TorchFunctionMode while the model's forward runs, as torch's own
  ``torch.distributed.tensor.experimental.context_parallel`` does for its CUDA kernels. The mode
  is not active in backward (torch's autograd engine does not carry it there), so a module's own
  ``torch.utils.checkpoint`` would recompute local attention: torch's checkpoint then fails on the
  saved tensors it does not find again, loudly. A transformers model's recompute is routed (its
  layers call the registered function again).

Either way the mask comes from the GLOBAL positions of this rank's tokens (split.py: causal over
the whole row, block-diagonal for packed rows): ``is_causal=True``, or an explicit mask that is
the local causal one (what a module builds from its own length), becomes the global causal mask
across chunks. Any other mask, dropout on the attention probabilities and non-causal attention
are refused with the reason: the ring and all-to-all compute causal attention over documents only.

transformers is never imported here: a model is a transformers model only when transformers is
already loaded (``sys.modules``) and the model is one of its classes.
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from paratrain.comm import collectives as C
from paratrain.comm.collectives import Axis
from paratrain.context_parallel.apply import cp_attention

_names = itertools.count()  # each door registers its own attention function in transformers


def transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (transformers already imported)."""
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, tf.PreTrainedModel)


class _RouteSdpa(TorchFunctionMode):
    """While active: ``F.scaled_dot_product_attention`` goes to the door; everything else as is."""

    def __init__(self, door: UserModuleDoor):
        super().__init__()
        self.door = door

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:  # this mode is off while its handler runs
            return self.door.sdpa(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


class UserModuleDoor:
    """Routes a user's module's (or a transformers model's) attention to cp_attention over ``axis``.

    ``split_positions`` is what ``Parallel.cp_split`` handed out last (this rank's global
    positions); a forward given ``position_ids=`` or ``positions=`` uses those instead."""

    def __init__(self, model: nn.Module, axis: Axis, method: str):
        self.axis, self.method = axis, method
        self.hf = transformers_model(model)
        self.split_positions: torch.Tensor | None = None
        # of the last forward: a transformers layer's recompute in backward attends with them too
        self.positions: torch.Tensor | None = None
        self.calls = 0
        self._mode: _RouteSdpa | None = None
        if self.hf:
            self._register_transformers(model)
        model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        model.register_forward_hook(self._after_forward, always_call=True)

    # -- around the model's forward ----------------------------------------------------------------

    def _before_forward(self, model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        positions = kwargs.get("position_ids", kwargs.get("positions"))
        if positions is None:
            positions = self.split_positions
        if positions is None:
            raise ValueError(f"cp = {self.axis.size}: call par.cp_split(x, y) on each batch before "
                             "model(x) (it gives this rank its tokens and their global positions), or "
                             "pass those positions as position_ids= / positions=")
        if self.hf:
            if len(args) > 1:  # attention_mask, position_ids ... would pass unseen
                raise ValueError(f"cp = {self.axis.size}: give {type(model).__name__} its input_ids "
                                 "positionally and everything else by keyword (attention_mask=, ...)")
            kwargs = self._transformers_kwargs(kwargs, positions)
        self.positions, self.calls = positions, 0
        if not self.hf:
            self._enter()
        return args, kwargs

    def _after_forward(self, model: nn.Module, args: tuple, output: object) -> None:
        self._exit()
        if output is not None and self.calls == 0:  # None: the forward raised; let its error through
            raise ValueError(
                f"cp = {self.axis.size}: {type(model).__name__}'s forward ran no attention through "
                + ("transformers' attention interface (model.config._attn_implementation)" if self.hf
                   else "torch.nn.functional.scaled_dot_product_attention")
                + ", so every rank attended only to its own positions: route its attention there, "
                "or use cp = 1")

    def _enter(self) -> None:
        if self._mode is None:
            self._mode = _RouteSdpa(self)
            self._mode.__enter__()

    def _exit(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    # -- the attention ---------------------------------------------------------------------------

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
               positions: torch.Tensor | None = None) -> torch.Tensor:
        """q [b, hq, s, d], k/v [b, hkv, s, d] of this rank's positions -> [b, hq, s, d]."""
        positions = self.positions if positions is None else positions
        if positions is None:
            raise RuntimeError("context-parallel attention ran outside the model's forward: call the "
                               "model itself (model(x)), not one of its submodules")
        b, s = q.shape[0], q.shape[2]
        if positions.shape[-1] != s:
            raise ValueError(f"cp = {self.axis.size}: attention over {s} positions but the positions "
                             f"of this forward have {positions.shape[-1]}: give the model the tokens and "
                             "positions par.cp_split returned for this batch")
        if self.method == "alltoall" and q.shape[1] % self.axis.size:
            raise ValueError(f"cp_method = 'alltoall' scatters the query heads over the cp ranks: "
                             f"{q.shape[1]} heads do not divide by cp ({self.axis.size}); use "
                             "cp_method = 'ring' or 'auto'")
        self.calls += 1
        return cp_attention(q, k, v, positions.expand(b, s), self.axis, self.method, scale)

    def sdpa(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
             scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        """F.scaled_dot_product_attention's signature, under context parallelism."""
        where = "F.scaled_dot_product_attention under cp"
        if attn_mask is not None and not is_local_causal(attn_mask, query.shape[-2]):
            raise ValueError(f"{where}: an attn_mask that is not the causal one is refused (the ring and "
                             "all-to-all compute causal attention over whole rows or packed documents): "
                             "pass is_causal=True, and packed rows' positions to par.cp_split")
        if attn_mask is None and not is_causal:
            raise ValueError(f"{where}: attention that is not causal (is_causal=False, no mask) is "
                             "refused: each rank's keys would be visible to every query, which the "
                             "ring and all-to-all do not compute; use cp = 1 for it")
        _refuse_dropout(where, dropout_p)
        return self.attend(query, key, value, scale)

    # -- transformers ------------------------------------------------------------------------------

    def _register_transformers(self, model: nn.Module) -> None:
        name = f"paratrain_cp_{next(_names)}"
        sys.modules["transformers"].AttentionInterface.register(name, self.transformers_attention)
        model.config._attn_implementation = name  # no mask function of that name: the model builds none

    def _transformers_kwargs(self, kwargs: dict, positions: torch.Tensor) -> dict:
        if kwargs.get("labels") is not None:
            raise ValueError(f"cp = {self.axis.size}: labels= makes the model shift them inside this "
                             "rank's positions, which crosses chunk borders wrongly; pass the targets "
                             "par.cp_split returns (shifted on the whole row) to par.token_mean_loss")
        mask = kwargs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ValueError(f"cp = {self.axis.size}: an attention_mask with masked positions is "
                             "refused (the mask is built from positions under cp): pack rows instead and "
                             "give par.cp_split their positions; mark padding with target -100")
        if kwargs.get("past_key_values", kwargs.get("cache")) is not None:
            raise ValueError(f"cp = {self.axis.size}: a KV cache is refused (generation does not run "
                             "context-parallel); use cp = 1 to generate")
        kwargs = {**kwargs, "attention_mask": None, "position_ids": positions}
        kwargs.setdefault("use_cache", False)
        return kwargs

    def transformers_attention(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: torch.Tensor | None,
                               dropout: float = 0.0, scaling: float | None = None,
                               is_causal: bool | None = None, **kwargs: object) -> tuple[torch.Tensor, None]:
        """transformers' attention-function signature: q/k/v [b, h, s, d] -> ([b, s, hq, d], None)."""
        where = f"{type(module).__name__} under cp"
        # probe kept: transformers' own attribute (decoder attention layers set it True)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if not causal or attention_mask is not None:
            raise ValueError(f"{where}: only causal attention without a mask of its own runs "
                             "context-parallel (the mask comes from the positions); use cp = 1")
        window, row = kwargs.get("sliding_window"), query.shape[2] * self.axis.size
        if kwargs.get("softcap") is not None or (window is not None and window < row):
            raise ValueError(f"{where}: a score softcap, or a sliding window shorter than the rows "
                             f"({window} < {row} positions), is refused (the ring computes full causal "
                             "attention over documents); use cp = 1 for this model")
        _refuse_dropout(where, dropout)
        y = self.attend(query, key, value, scaling, kwargs.get("position_ids"))
        return y.transpose(1, 2).contiguous(), None


def _refuse_dropout(where: str, p: float) -> None:
    if p > 0:
        raise ValueError(f"{where}: attention dropout ({p}) is refused (each rank would drop its "
                         "own probabilities of blocks it never holds whole); set it to 0")


def is_local_causal(mask: torch.Tensor, s: int) -> bool:
    """Whether ``mask`` [..., s, s] is the plain causal mask of ``s`` positions: bool (True = may
    attend) or additive (0 where allowed, -inf or the dtype's minimum elsewhere)."""
    if mask.shape[-2:] != (s, s):
        return False
    tril = torch.ones(s, s, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        return bool((mask == tril).all())
    blocked = torch.isneginf(mask) | (mask <= torch.finfo(mask.dtype).min)
    return bool(((mask == 0) == tril).all() and (blocked == ~tril).all())


def token_mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, axis: Axis, summed_ranks: int,
                             ignore_index: int = -100) -> torch.Tensor:
    """Cross-entropy over the counted targets of the whole global batch (every rank of ``axis``).

    Its value is the global token mean (the same on every rank: what one process computes on all
    the rows); its gradient is this rank's share, times ``summed_ranks`` because the library's
    ``backward`` divides by it before the ranks' gradients are summed. So loss masks that fall
    unevenly on the ranks (or on the cp chunks) still give one process's gradient."""
    wide = torch.promote_types(logits.dtype, torch.float32)
    local = F.cross_entropy(logits.flatten(0, -2).to(wide), targets.flatten(), ignore_index=ignore_index,
                            reduction="sum")
    stats = torch.stack([local.detach().to(torch.float64),
                         (targets != ignore_index).sum().to(torch.float64)])
    if axis.size > 1:
        C.all_reduce(stats, axis)
    count = max(1.0, float(stats[1]))  # a batch with nothing counted adds 0
    share = local * (summed_ranks / count)
    return share + (float(stats[0]) / count - share).detach()
