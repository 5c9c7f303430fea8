"""Cut the model into pipeline stages: each rank keeps only the blocks of the stages it owns.

The model is built on the ``meta`` device, so the parts a rank does not own are never allocated:
``split_for_pipeline`` deletes the other blocks from the model family's block dict (``layers`` for
the Llama family; the ones left keep their single-device names, ``layers.7.attn.wq.weight``), and
sets the modules the family runs before the blocks (``embed``: first stage only) and after them
(``norm``, ``lm_head``: last stage only) to ``None`` where they are not owned (models/family.py).

With ``v`` virtual stages (interleaved 1F1B) the model is cut into ``p * v`` stages dealt
round-robin: rank ``r`` owns stages ``r, r + p, ...``, one ``StageChunk`` each. The V schedules
(zbv, dualpipev: schedules_zb.py) cut it into ``2p`` stages placed in a V: rank ``r`` owns stages
``r`` and ``2p - 1 - r`` (``schedules.stage_rank``), so rank 0 holds both the embedding and the
head: a tied pair stays one parameter there, as on one device (no copy, no message).

Split of the blocks (``parallel.pp_split``):

* default: the same number of blocks per stage; when they do not divide evenly the first
  stages take one more (the last stage also runs the final norm, the LM head and the loss);
* ``"auto"``: contiguous blocks balanced by modelled cost (perf/stages.py ``balanced_split`` on
  the op model's costs of a nominal device, the cut the planner predicts): the first stage also
  pays for the embedding, the last for the final norm, the LM head and the loss (a large
  vocabulary weighs several blocks), so block counts may be uneven (Megatron-LM's
  account-for-embedding / account-for-loss options are the same idea, in units of one block);
* ``"3,1"``: explicit blocks per stage (``p * v`` numbers, each >= 1, summing to ``n_layers``).

Tied embeddings across the first and last stage: the last stage's ``lm_head.weight`` is its own
parameter, initialised from ``embed.weight`` (``tied_name``); both copies carry
``ParamInfo.stage_copies = 2``, set here at the split, before any strategy buckets them (the
global grad norm counts them once); their gradients are summed between the two ranks after
backward (``TiedEmbedding``), so they stay identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from paratrain.comm import collectives as C
from paratrain.mesh import ParallelMesh
from paratrain.models.family import ModelFamily
from paratrain.models.registry import family_of
from paratrain.models.shape import ModelShape
from paratrain.perf.stages import balanced_split, nominal_chunk_costs
from paratrain.pipeline.schedules import SCHEDULES, stage_rank
from paratrain.sharding import update_info


def parse_split(text: str | None, n_layers: int, n_stages: int, costs: tuple[float, ...] = (1.0, 0.0, 0.0)
                ) -> list[int]:
    """Blocks per stage. ``costs`` = (one block, the last stage's extra[, the first stage's extra]) in
    any unit, used by "auto"."""
    if n_stages > n_layers:
        raise ValueError(f"{n_stages} pipeline stages (pp * virtual_stages) but the model has only "
                         f"{n_layers} layers: lower --pp / --virtual-stages or use a deeper model")
    if text is None or text == "":
        base, extra = divmod(n_layers, n_stages)
        return [base + (1 if s < extra else 0) for s in range(n_stages)]
    if text == "auto":
        block, last, first = (tuple(costs) + (0.0,))[:3]
        return balanced_split(n_layers, n_stages, block, first=first, last=last)
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"parallel.pp_split = {text!r}: give blocks per stage as integers, e.g. '3,1', "
                         "or 'auto'") from None
    if len(counts) != n_stages or min(counts) < 1 or sum(counts) != n_layers:
        raise ValueError(f"parallel.pp_split = {text!r} must list {n_stages} stages (pp * virtual_stages), "
                         f"each >= 1 block, summing to the model's {n_layers} layers")
    return counts


def layer_costs(cfg: ModelShape, device_type: str = "cpu") -> tuple[float, float, float]:
    """(one block, the last stage's extra, the first stage's extra) in seconds per sequence, from
    the op model of a nominal device of this type (never measured: every rank must compute the
    same split)."""
    block, first, last = nominal_chunk_costs(cfg, device_type)
    return block, last, first


def stage_layers(counts: list[int]) -> list[list[int]]:
    """Block indices of every stage, in order."""
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


@dataclass
class StageChunk:
    """One (virtual) stage held by this rank: a few blocks of the shared, pruned model."""

    model: nn.Module
    stage: int
    layers: list[int]
    is_first: bool
    is_last: bool
    family: ModelFamily  # looked up once: this is called for every micro-batch

    def __call__(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s] (first stage) or hidden [b, s, dim] -> hidden [b, s, dim] or logits;
        ``positions`` [b, s]: the micro-batch's, whole on every stage and tp rank (None: 0..s-1)."""
        return self.family.forward_stage(self.model, x, self.layers, self.is_first, self.is_last, positions)

    def modules(self) -> list[nn.Module]:
        """The modules this chunk runs (its side losses are this stage's: executor.py)."""
        f, blocks = self.family, self.family.blocks_of(self.model)
        first = [m for _, m in f.present(self.model, f.before)] if self.is_first else []
        last = [m for _, m in f.present(self.model, f.after)] if self.is_last else []
        return first + [blocks[str(i)] for i in self.layers] + last


def split_for_pipeline(model: nn.Module, mesh: ParallelMesh, *, virtual_stages: int = 1,
                       split: str | None = None, schedule: str = "1f1b") -> list[StageChunk]:
    """Prune ``model`` (built on meta) to this rank's stages (which ones: the ``schedule``'s
    placement and stages per rank); return one chunk per stage, in order."""
    family = family_of(model, "pipeline parallelism (its blocks and split points)")
    p, rank = mesh.pp.size, mesh.pp.rank
    kind = SCHEDULES[schedule]
    n_stages = p * kind.chunks_per_rank(virtual_stages)
    layers = family.blocks_of(model)
    costs = layer_costs(model.cfg, mesh.device.type) if split == "auto" else (1.0, 0.0, 0.0)
    counts = parse_split(split, len(layers), n_stages, costs)
    per_stage = stage_layers(counts)
    mine = [s for s in range(n_stages) if stage_rank(s, p, kind.placement) == rank]
    keep = {i for s in mine for i in per_stage[s]}
    for key in [k for k in layers if int(k) not in keep]:
        del layers[key]
    for name in family.before if 0 not in mine else ():
        setattr(model, name, None)
    for name in family.after if n_stages - 1 not in mine else ():
        setattr(model, name, None)
    if family.is_tied(model) and not ends_share_rank(p, n_stages, kind.placement):
        _mark_tied(model, *family.tied)
    return [StageChunk(model, s, per_stage[s], s == 0, s == n_stages - 1, family) for s in mine]


def ends_share_rank(p: int, n_stages: int, placement: str) -> bool:
    """Whether the first and the last stage are on one rank (a V placement): a tied embedding and
    head are then one parameter, summed by autograd as on one device."""
    return stage_rank(0, p, placement) == stage_rank(n_stages - 1, p, placement)


def _held(model: nn.Module, name: str) -> nn.Parameter | None:
    """Parameter ``name`` (``embed.weight``, ``embed.wte.weight``) if this stage still holds its
    module: a module the split set to None anywhere on the path means it does not."""
    *path, attr = name.split(".")
    module = model
    for part in path:
        module = getattr(module, part, None)  # probe kept: a stage may have dropped it
        if module is None:
            return None
    return getattr(module, attr)


def _mark_tied(model: nn.Module, copy: str, owner: str) -> None:
    """The owner (embedding) and its copy (LM head) live on two stages: both count once in the
    grad norm (and ZeRO buckets them by that count, so this must be known before any strategy
    exists); the copy is saved and exported under the owner's name, by the first stage."""
    if (w := _held(model, owner)) is not None:
        update_info(w, stage_copies=2)
    if (w := _held(model, copy)) is not None:
        update_info(w, stage_copies=2, tied_to=owner)


class TiedEmbedding:
    """Sum the gradients of the tied embedding / LM head between the first and last stage.

    Each copy's gradient is its own stage's contribution; their sum is the gradient of the
    single-device (shared) weight. Build it on every rank, after materialize (which makes new
    parameter objects); group creation is collective over the world.
    """

    def __init__(self, model: nn.Module, mesh: ParallelMesh, *, same_rank: bool = False):
        self.params: list[nn.Parameter] = []
        self.axis: C.Axis | None = None
        family = family_of(model)
        # Both ends on this rank (same_rank: ends_share_rank): one parameter, whose gradient two
        # stages' backwards add to (the executor's sync points treat those stages as one).
        self.one_parameter = family.is_tied(model) and mesh.pp.size > 1 and same_rank
        if not family.is_tied(model) or mesh.pp.size == 1 or same_rank:
            return
        axis = _ends_axis(mesh)
        self.params = [w for w in (_held(model, n) for n in reversed(family.tied)) if w is not None]
        self.axis = axis if self.params else None

    @torch.no_grad()
    def all_reduce_grads(self) -> None:
        for p in self.params:
            if p.grad is not None:
                C.all_reduce(p.grad, self.axis)


def _ends_axis(mesh: ParallelMesh) -> C.Axis:
    """A two-rank axis joining this pipeline's first and last stage (the pp axis when p = 2)."""
    pp = mesh.pp
    if pp.size == 2:
        return pp
    mine = None
    for members in mesh.shape.groups("pp"):
        ends = [members[0], members[-1]]
        group = mesh.new_group(ends)  # collective over the world: every rank creates every group
        if mesh.rank in members:
            mine = (ends, group)
    ends, group = mine
    index = ends.index(mesh.rank) if mesh.rank in ends else 0
    return C.Axis("pp", 2, index, ends, group, mesh.counter)
