"""memory/host_heap.py: on the CPU, a block of at least TRIM_MIN_BLOCK_BYTES hands the freed host
heap back after its forward and as its backward begins; smaller blocks and other devices are left
alone. (What it saves is measured, not asserted: RSS depends on the allocator's state, see the
module's docstring and docs/benchmarks.md.)"""

from __future__ import annotations

import pytest
import torch

from paratrain import device
from paratrain.memory import host_heap
from paratrain.models import build_model, init_weights
from paratrain.models.families.llama import preset
from paratrain.zero import fsdp
from tests.harness import run_layout, tiny_cfg


def _tiny() -> tuple[object, torch.nn.Module]:
    c = preset("tiny", max_seq_len=32)
    model = build_model(c)
    init_weights(model, 0, c)
    return c, model


def test_large_blocks_trim_after_forward_and_before_backward(monkeypatch):
    c, model = _tiny()
    events: list[str] = []
    monkeypatch.setattr(host_heap, "TRIM_MIN_BLOCK_BYTES", 0)  # every tiny block counts as large
    monkeypatch.setattr(host_heap, "release_host_heap", lambda: events.append("trim"))
    n = c.n_layers
    if not device.can_release_host_heap():  # no glibc: nothing is hooked
        assert host_heap.trim_around_large_blocks(model, torch.device("cpu")) == 0
        return
    assert host_heap.trim_around_large_blocks(model, torch.device("cpu")) == n
    x = torch.randint(0, c.vocab_size, (2, 16))
    out = model(x)
    assert events == ["trim"] * n  # one per block's forward
    out.float().pow(2).mean().backward()
    assert events == ["trim"] * (2 * n)  # and one as each block's backward begins


def test_small_blocks_and_other_devices_are_left_alone(monkeypatch):
    _, model = _tiny()
    assert host_heap.trim_around_large_blocks(model, torch.device("cpu")) == 0  # tiny blocks: KiBs
    monkeypatch.setattr(host_heap, "TRIM_MIN_BLOCK_BYTES", 0)
    assert host_heap.trim_around_large_blocks(model, torch.device("meta")) == 0
    assert host_heap.trim_around_large_blocks(torch.nn.Linear(4, 4), torch.device("cpu")) == 0  # no family


@pytest.mark.parametrize("trim", [True, False], ids=["default", "no-trim-host-heap"])
def test_no_trim_host_heap_turns_both_trims_off(monkeypatch, tmp_path, trim):
    """`--no-trim-host-heap` (train.trim_host_heap = false): neither the large blocks' trims nor
    ZeRO-3's once-a-step trim with frozen units runs; by default both do (ZeRO-3 + LoRA, one
    process, every block counted as large)."""
    if not device.can_release_host_heap():
        pytest.skip("no glibc: nothing trims")
    calls = {"blocks": 0, "zero3": 0}

    def counting(kind: str):
        return lambda: calls.__setitem__(kind, calls[kind] + 1)

    monkeypatch.setattr(host_heap, "TRIM_MIN_BLOCK_BYTES", 0)
    monkeypatch.setattr(host_heap, "release_host_heap", counting("blocks"))
    monkeypatch.setattr(fsdp, "release_host_heap", counting("zero3"))
    cfg = tiny_cfg(tmp_path / "run", **{"train.steps": 2, "parallel.zero": 3, "lora.rank": 4,
                                        "train.trim_host_heap": trim})
    run_layout(cfg)
    if trim:
        assert calls["blocks"] > 0 and calls["zero3"] >= 2, calls
    else:
        assert calls == {"blocks": 0, "zero3": 0}
