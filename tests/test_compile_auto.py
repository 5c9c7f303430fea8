"""Compiled blocks' shapes (memory/compile.py ``shapes_of``) and ``--compile auto``
(memory/compile_choice.py): the decision on given timings, and that a short run picks eager
without measuring and records why. No test here depends on which of eager or compiled is faster
on the machine running it."""

from __future__ import annotations

import torch
import torch._dynamo

from paratrain.memory.compile import compile_blocks, shapes_of
from paratrain.models import build_model, init_weights, preset
from paratrain.models.registry import family_of


def test_moe_blocks_do_not_hit_the_recompile_limit():
    """A MoE block routes a different token count to each expert at every step: traced with fixed
    shapes, every new count recompiled until torch's recompile limit (8), after which the block ran
    eager, silently. Twelve steps of new routings with the limit made an error: dynamic sizes
    after the first change keep every frame well inside it (aot_eager: no code generation)."""
    shape = preset("tiny-moe", max_seq_len=16, n_layers=1)
    model = build_model(shape)
    init_weights(model, 0, shape)
    assert shapes_of(family_of(model, "test").blocks_of(model)["0"]) is None
    torch._dynamo.reset()  # frames compiled by earlier tests in this process count to the limit too
    compile_blocks(model, backend="aot_eager")
    gen = torch.Generator().manual_seed(0)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for _ in range(12):
            model(torch.randint(0, shape.vocab_size, (2, 16), generator=gen)).sum().backward()
    torch._dynamo.reset()


def test_dense_blocks_stay_static():
    """A dense block sees one shape per run: static graphs, whose kernels are the fastest."""
    model = build_model(preset("tiny", max_seq_len=16, n_layers=1))
    assert shapes_of(family_of(model, "test").blocks_of(model)["0"]) is False
