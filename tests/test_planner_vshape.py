"""The planner's V: zbv and dualpipev hold the first and the last stage on rank 0, so the final
norm, the head and the loss (their activations, the log-probs' gradient, their compute, their
tensors) are rank 0's there, not rank pp - 1's as in every other schedule."""

from __future__ import annotations

import pytest

from paratrain.models import preset
from paratrain.pipeline.schedules import stage_rank
from paratrain.planner import cost, memory
from paratrain.planner.machine import local_cluster


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb-h1", 1),
                                        ("zbv", 2), ("dualpipev", 2)])
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_head_rank_is_where_the_runtime_puts_the_last_stage(schedule, v, pp):
    lay = memory.Layout(pp=pp, v=v, schedule=schedule)
    placement = "v" if schedule in ("zbv", "dualpipev") else "loop"
    assert memory.head_rank(lay) == stage_rank(pp * v - 1, pp, placement)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_a_v_prices_the_head_on_rank_0(schedule):
    """A vocabulary of 32,768 over dim 64: the head outweighs a block many times, so the rank that
    holds it is the busiest in memory (its log-probs and their gradient) and in compute. Before,
    the planner put it on rank 1 in a V too: rank 1 came out busiest and rank 0's head unpriced."""
    c = preset("tiny", vocab_size=32768, n_layers=4, max_seq_len=64)
    tr = memory.Training(64, 8, precision="fp32")
    lay = memory.Layout(pp=2, v=2, schedule=schedule, micro_batch=1)
    mem = memory.device_memory(c, tr, lay, local_cluster(2))
    assert mem.stage == 0
    assert mem.transient >= 64 * c.vocab_size * 4  # the log-probs' gradient, one micro-batch
    compute = [t[0] for t in cost.stage_costs(c, tr, lay, local_cluster(2), counts=[1, 1, 1, 1])]
    assert compute[0] > 2 * compute[1]
    straight = [t[0] for t in cost.stage_costs(c, tr, memory.Layout(pp=2, v=2, schedule="interleaved",
                                                                     micro_batch=1), local_cluster(2),
                                               counts=[1, 1, 1, 1])]
    assert straight[1] > 2 * straight[0]
