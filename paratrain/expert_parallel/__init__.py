"""Expert parallelism: each rank of an expert-parallel group holds E/ep experts (dispatch.py,
applied by apply.py)."""

from paratrain.expert_parallel.apply import apply_expert_parallel
from paratrain.expert_parallel.dispatch import (
    dispatch_and_run,
    owned_experts,
    split_expert_units,
)

__all__ = ["apply_expert_parallel", "dispatch_and_run", "owned_experts", "split_expert_units"]
