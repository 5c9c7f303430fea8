"""What a tensor-parallel style needs to build its module: the tp axis, whether sequence
parallelism is on, and the model's config (head counts for the k/v style)."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.comm.collectives import Axis


@dataclass(frozen=True)
class Context:
    axis: Axis
    sequence_parallel: bool
    cfg: object  # the model's config: head counts for the k/v style
