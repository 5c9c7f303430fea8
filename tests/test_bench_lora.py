"""`paratrain bench lora` runs both comparisons and reports what docs/benchmarks.md quotes.

--vs peft: the two sides start from the same base and adapters and see the same rows, so their
loss curves must agree to float noise (if PEFT's adapters were not set to paratrain's initial
values, or the sides saw other rows, the first losses would differ by far more than 1e-4).
--vs full: the LoRA side holds gradients and optimizer state for the adapters only.
"""

from __future__ import annotations

import argparse

import pytest

from paratrain.bench import lora


def _args(**overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    lora.add_arguments(parser)
    args = parser.parse_args(["--model", "tiny", "--seq-len", "64", "--global-batch", "4", "--steps", "2",
                              "--warmup", "1", "--rounds", "1", "--rank", "4", "--threads", "1"])
    vars(args).update(overrides)
    return args


def test_vs_peft_has_the_same_loss_curve():
    pytest.importorskip("peft")
    result = lora.run(_args())
    assert result["paratrain_tokens_per_s"] > 0 and result["peer_tokens_per_s"] > 0
    assert len(result["paratrain_losses"]) == 3 == len(result["peer_losses"])
    assert result["max_loss_difference"] < 1e-4, result


def test_vs_full_holds_adapter_state_only():
    result = lora.run(_args(vs="full", nproc=2))
    lo, full = result["configs"]["lora"], result["configs"]["full"]
    assert lo["rank0_grads_mib"] * 10 < full["rank0_grads_mib"]
    assert lo["rank0_optim_mib"] == pytest.approx(2 * lo["rank0_grads_mib"])
