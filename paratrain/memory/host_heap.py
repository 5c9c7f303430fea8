"""Large blocks on the CPU: the freed host heap handed back block by block.

glibc serves allocations under its mmap threshold (which rises to 32 MiB once large buffers are
freed) from the heap, and keeps what is freed there for reuse. A block's forward on the CPU frees
its transient buffers (a dequantised chunk of a quantised base, attention scores, MLP products)
between the activations it keeps for backward; the next block's requests do not fit the holes,
so the resident set grows by the holes, block after block, until backward. Measured (llama-7b's
block, 6 of them, LoRA 16 on an nf4 base, sequence 512, fp32, one process; /tmp scripts around
``paratrain train ... --memory-snapshot 2``): peak RSS 4,305 MiB for 882 MiB of parameters and
919 MiB of activations; handing the freed pages back after each block's forward and before its
backward (``device.release_host_heap``, malloc_trim) 2,496 MiB, ~15 % more step time (the pages
are faulted in again); a fixed 1 MiB mmap threshold 2,304 MiB but +70 % step time. At 32 such
blocks the difference is ~10 GB of a 23 GiB machine: the 7B QLoRA fine-tune fits or does not.

So blocks of at least ``TRIM_MIN_BLOCK_BYTES`` (their parameters' bytes as held: a 7B block's
quantised base, a 1B model's fp32 block) trim around their passes; small blocks (the tests',
``small``'s, whose holes are a few MiB) do not pay the trims. Not on CUDA (the caching allocator
holds device memory; the host heap is not where activations live) nor without glibc.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from paratrain.device import can_release_host_heap, release_host_heap
from paratrain.models.registry import NoFamilyError, family_of

TRIM_MIN_BLOCK_BYTES = 64 * 2**20


def trim_around_large_blocks(model: nn.Module, device: torch.device) -> int:
    """Hooks on each large block of ``model`` (a family's) that release the freed host heap after
    its forward and before its backward; the number of blocks hooked (0 off the CPU, without glibc,
    for a model of no family)."""
    if device.type != "cpu" or not can_release_host_heap():
        return 0
    try:
        blocks = family_of(model, "host heap trims").blocks_of(model).values()
    except (NoFamilyError, AttributeError):  # a pipeline stage keeps its blocks; a user model has none
        return 0
    large = [b for b in blocks if _held_bytes(b) >= TRIM_MIN_BLOCK_BYTES]
    for block in large:
        block.register_forward_hook(_after_forward)
    return len(large)


def _held_bytes(block: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*block.parameters(), *block.buffers()))


def _after_forward(module: nn.Module, args: object, output: object) -> None:
    release_host_heap()
    out = output[0] if isinstance(output, tuple) else output
    if isinstance(out, torch.Tensor) and out.requires_grad:
        out.register_hook(_before_backward)  # runs as this block's backward begins


def _before_backward(grad: torch.Tensor) -> None:
    release_host_heap()  # the later block's backward has freed its buffers; the gradient unchanged
