"""8-bit AdamW's moments as the trainer cuts their blocks (optim/adamw8bit.py ``Blocks``), per tensor.

The uniform figure (2 bytes per element + 8 per 2048-element block: ``memory.state_bytes_per_param``)
holds for a tensor cut in flat 2048-element blocks. The trainer cuts a tensor the tp plan splits
along dim d (recorded at every tp, tp = 1 included, so the state is the same in every layout) into
pieces = gcd(size of d, ``TP_PIECES``) pieces, and its blocks never cross one: viewed as [outer,
pieces, run], a block is gcd(run, 2048) elements. A column-parallel [out, in] weight has runs of
out / 16 * in (blocks of 2048 as a rule); a row-parallel one [out, in] split along in has runs of
in / 16, so blocks of in / 16 when that is below 2048: 16 * 2048 / in times the scales. A tensor of
fewer than ``MIN_8BIT_SIZE`` elements (full size) keeps fp32 moments, 8 bytes each (norm gains,
biases, a small router).

The planner may not import optim/ (the planner contract in .importlinter), so the rule is written
again here from its definition; tests/test_planner_optim8.py checks it against ``blocks_of`` for
every parameter of every family's tiny preset, and against a tp2 run's counted optimizer bytes.

Tensors are listed from the shape as ``local.param_numels`` lists them (the same order and
conventions), with their full shapes and the dim the family's tp plan splits: q / k / v and the
MLP's gate / up (fc) column-parallel (dim 0, their biases too), o and down (proj) row-parallel
(dim 1, bias whole), the embedding, learned positions and LM head vocab-parallel (dim 0). Each
expert is a SwiGLU MLP of ``moe_ffn_dim`` split by tp like the dense one (gate / up column, down
row: models/moe.py ``Expert``; tensor_parallel/experts.py) and held by E / ep ranks' worth: its down
projection's runs are moe_ffn_dim / 16 (48 elements for Qwen3-MoE's 768), so its scales are
priced per tensor too (``expert_correction``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from paratrain.models.shape import ModelShape, learned_positions, linear_bias
from paratrain.sharding import TP_PIECES

BLOCK_SIZE = 2048  # optim/adamw8bit.py BLOCK_SIZE (config optim.block_size's default)
MIN_8BIT_SIZE = 4096  # optim/adamw8bit.py MIN_8BIT_SIZE (optim.min_8bit_size's default)
UNIFORM = 2 + 8 / BLOCK_SIZE  # memory.state_bytes_per_param's moments per element


@dataclass(frozen=True)
class Tensor:
    """One parameter's full shape and the dim the tp plan splits (None: no split)."""

    shape: tuple[int, ...]
    tp_dim: int | None = None

    def local(self, tp: int) -> int:
        """Elements on one tp rank: a split dim divided when tp divides it (else replicated)."""
        n = math.prod(self.shape)
        return n // tp if self.tp_dim is not None and self.shape[self.tp_dim] % tp == 0 else n

    def block(self, block: int = BLOCK_SIZE) -> int | None:
        """Elements per block (optim/adamw8bit.py ``Blocks.size``); None for flat blocks."""
        d = self.tp_dim
        pieces = math.gcd(self.shape[d], TP_PIECES) if d is not None else 1
        if pieces == 1:
            return None
        run = math.prod(self.shape) // (math.prod(self.shape[:d]) * pieces)
        return math.gcd(run, block)

    def moment_bytes(self, tp: int, block: int = BLOCK_SIZE, min_size: int = MIN_8BIT_SIZE) -> float:
        """Bytes of both moments on one tp rank: 1 byte each + one fp32 absmax each per block, or
        fp32 moments for a small tensor."""
        n = self.local(tp)
        if math.prod(self.shape) < min_size:
            return 8.0 * n
        size = self.block(block)
        blocks = math.ceil(n / block) if size is None else n // size
        return 2.0 * n + 8.0 * blocks


def stage_tensors(c: ModelShape, blocks: int, first: bool, last: bool, moe_blocks: int = 0) -> list[Tensor]:
    """A stage's parameters but the experts' matrices, full shapes (``local.param_numels``'s list):
    ``blocks`` blocks of which ``moe_blocks`` hold a router and experts in place of the MLP."""
    h, f = c.dim, c.ffn_dim
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    biased = linear_bias(c)
    norm = [Tensor((h,))] * (2 if c.norm == "layer" else 1)

    def col(rows: int, bias: bool, cols: int = h) -> list[Tensor]:
        return [Tensor((rows, cols), 0)] + ([Tensor((rows,), 0)] if bias else [])

    def row(cols: int) -> list[Tensor]:
        return [Tensor((h, cols), 1)] + ([Tensor((h,))] if biased else [])

    attn = [*norm, *col(q, c.qkv_bias), *col(kv, c.qkv_bias), *col(kv, c.qkv_bias), *row(q), *norm]
    extra = norm * (c.norms_per_block - 2) + ([Tensor((c.head_dim,))] * 2 if c.qk_norm else [])
    mlp = col(f, biased) * (c.mlp_matrices - 1) + row(f)
    router = [Tensor((c.n_experts, h))] if c.n_experts else []
    out = [Tensor((c.vocab_size, h), 0)] if first else []
    if first and learned_positions(c):
        out.append(Tensor((c.max_seq_len, h), 0))
    out += (attn + mlp + extra) * (blocks - moe_blocks) + (attn + router + extra) * moe_blocks
    if last:
        out += [*norm] + ([] if c.tie_embeddings and first else [Tensor((c.vocab_size, h), 0)])
    return out


def expert_tensors(c: ModelShape) -> list[Tensor]:
    """One expert's matrices, full shapes: gate and up [moe_ffn, dim] column-parallel, down
    [dim, moe_ffn] row-parallel (no biases)."""
    h, f = c.dim, c.moe_ffn_dim
    return [Tensor((f, h), 0)] * (c.mlp_matrices - 1) + [Tensor((h, f), 1)]


def expert_correction(c: ModelShape, tp: int, ep: int, moe_blocks: int, *, block: int = BLOCK_SIZE,
                      min_size: int = MIN_8BIT_SIZE) -> float:
    """Bytes of the 8-bit moments of a stage's local experts (E / ep in each of ``moe_blocks``
    blocks) on one tp rank as the trainer cuts them, minus the uniform figure for them."""
    if not c.n_experts:
        return 0.0
    one = sum(t.moment_bytes(tp, block, min_size) - UNIFORM * t.local(tp) for t in expert_tensors(c))
    return one * (c.n_experts // ep) * moe_blocks


def moments_correction(c: ModelShape, tp: int, blocks: int, first: bool, last: bool, moe_blocks: int = 0,
                       *, block: int = BLOCK_SIZE, min_size: int = MIN_8BIT_SIZE) -> float:
    """Bytes of a stage's 8-bit moments on one tp rank as the trainer cuts them (``block``,
    ``min_size``: the run's optim.block_size and optim.min_8bit_size), minus the uniform figure for
    the same elements (what ``memory`` adds to its optimizer bytes; experts excluded)."""
    tensors = stage_tensors(c, blocks, first, last, moe_blocks)
    return sum(t.moment_bytes(tp, block, min_size) - UNIFORM * t.local(tp) for t in tensors)
