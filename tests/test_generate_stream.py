"""Layer-streamed generation (inference/stream.py): equal to in-memory generation, under its memory
limit, refusing a limit below one block, and leaving no thread or offload folder behind.

float64 models: a near-tie between two logits cannot flip greedy argmax, and the streamed forward
runs the same ops on the same values, so logits are compared for exact equality."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from paratrain import cli
from paratrain.config import ConfigError
from paratrain.inference.loop import Sampling, decode, local_step
from paratrain.inference.stream import (
    MemoryLimitError,
    StreamedModel,
    parse_bytes,
    plan_memory,
    streamed_step,
)
from paratrain.inference.stream_command import check_offload, generate_ids
from paratrain.inference.weights import RunWeights
from paratrain.models.families.gpt2.model import GPT2Config
from paratrain.models.hf import HFCheckpoint, load_pretrained
from paratrain.models.registry import build_model
from paratrain.readahead import prefetch_threads
from tests.hf_models import save_hf

PROMPTS = [[5, 17, 30, 2, 9], [44, 3], [7, 8, 9, 10, 11, 12, 13]]
GREEDY = Sampling(max_new_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf")
    save_hf(path, "llama", num_hidden_layers=4)
    return path


def recording(step):
    seen = []

    def wrapped(ids, positions, cache):
        seen.append(step(ids, positions, cache))
        return seen[-1]

    return wrapped, seen


def plan_for(limit: int, dtype: torch.dtype = torch.float64):
    return lambda model: plan_memory(model, limit, batch=len(PROMPTS), prompt=7, capacity=13, dtype=dtype)


def reference(folder: Path):
    model = load_pretrained(str(folder))[0].double()
    step, seen = recording(local_step(model))
    return decode(step, PROMPTS, GREEDY), seen


def streamed(folder: Path, offload: str, limit: int, **kw):
    with StreamedModel(HFCheckpoint.open(str(folder)), plan_for(limit), offload=offload,
                       dtype=torch.float64, **kw) as sm:
        step, seen = recording(streamed_step(sm))
        return decode(step, PROMPTS, GREEDY), seen, sm


def probe(folder: Path, dtype: torch.dtype = torch.float64):
    """The plan of the test model under an ample limit (everything resident; its minimum is known)."""
    source = HFCheckpoint.open(str(folder))
    return StreamedModel(source, plan_for(10**9, dtype), offload="disk", dtype=dtype).plan


@pytest.mark.parametrize("offload", ["disk", "cpu"])
def test_streamed_equals_in_memory(folder, offload, tmp_path):
    want, want_logits = reference(folder)
    plan = probe(folder)
    one_resident = plan.minimum + plan.block  # one block resident, three stream
    got, logits, sm = streamed(folder, offload, one_resident, offload_dir=str(tmp_path / "off") if
                               offload == "disk" else None)
    assert sm.plan.resident == ("0",) and sm.plan.streamed == ("1", "2", "3")
    assert [g.ids for g in got] == [w.ids for w in want]
    for a, b in zip(logits, want_logits):
        assert torch.equal(a, b)
    assert not prefetch_threads()
    if offload == "disk":  # the user's folder stays, the block files go
        assert (tmp_path / "off").is_dir() and not list((tmp_path / "off").iterdir())


def test_limit_below_one_block_is_refused(folder):
    minimum = probe(folder).minimum
    with pytest.raises(MemoryLimitError, match=f"minimum of {minimum} bytes"):
        StreamedModel(HFCheckpoint.open(str(folder)), plan_for(minimum - 1), offload="disk",
                      dtype=torch.float64)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_thread_and_folder_gone_after_run_and_error(folder, monkeypatch, error):
    """An error (or Ctrl-C) inside a streamed block, while the next block is being prefetched."""
    minimum = probe(folder).minimum
    _, _, sm = streamed(folder, "disk", minimum)
    assert sm.plan.streamed and sm.folder is not None and not sm.folder.exists()
    assert not prefetch_threads()
    sm = StreamedModel(HFCheckpoint.open(str(folder)), plan_for(minimum), offload="disk",
                       dtype=torch.float64)
    assert prefetch_threads() and sm.folder.exists()
    step = streamed_step(sm)
    assert "2" in sm.plan.streamed
    def fail(x):
        raise error("boom")

    monkeypatch.setattr(sm.model.layers["2"].mlp, "forward", fail)
    with pytest.raises(error, match="boom"):
        decode(step, PROMPTS, GREEDY)
    assert not prefetch_threads() and not sm.folder.exists()


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 * 2**30 and parse_bytes("500MB") == 500 * 10**6
    assert parse_bytes("40M") == 40 * 2**20 and parse_bytes("1234") == 1234
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")


CHILD = """
import json, sys, torch
from paratrain import cli
from paratrain.config import ConfigError
from paratrain.inference.loop import Sampling, decode
from paratrain.inference.stream import StreamedModel, plan_memory, streamed_step
from paratrain.inference.stream_command import warm_up
from paratrain.models.hf import HFCheckpoint
torch.set_num_threads(1)
folder, limit = sys.argv[1], int(sys.argv[2])
source = HFCheckpoint.open(folder)
warm_up(source.model_cfg)  # torch's meta machinery (~70 MiB of modules) and kernels' first-call state
def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
base = rss("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
prompts = [[5, 17, 30, 2, 9]]
plan = lambda m: plan_memory(m, limit, batch=1, prompt=5, capacity=9, dtype=torch.float32)
with StreamedModel(source, plan, offload="disk") as sm:
    out = decode(streamed_step(sm), prompts, Sampling(max_new_tokens=4, temperature=0))
    streamed = len(sm.plan.streamed)
print(json.dumps({"growth": rss("VmHWM:") - base, "tokens": len(out[0].ids), "streamed": streamed}))
"""


def test_model_three_times_the_limit_stays_under_it(tmp_path):
    save_hf(tmp_path, "llama", tokenizer=False, num_hidden_layers=44, hidden_size=256,
            intermediate_size=688, num_attention_heads=4, num_key_value_heads=2)
    size = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    limit = 40 * 2**20
    assert size >= 3 * limit
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), str(limit)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["tokens"] == 4 and got["streamed"] > 20
    assert 0 < got["growth"] < limit, got


def test_backend_equals_in_memory_and_says_its_plan(folder, capsys):
    """The command's fp32 path: the same fp32 ops as the in-memory model (bit-exact, so no near-tie
    can differ)."""
    want = decode(local_step(load_pretrained(str(folder))[0]), PROMPTS, GREEDY)
    request = SimpleNamespace(offload="disk", memory_limit=str(probe(folder, torch.float32).minimum),
                              init_from=str(folder),
                              run=None, checkpoint=None, offload_dir=None, sampling=GREEDY)
    got = generate_ids(request, SimpleNamespace(ids=PROMPTS, eos_ids=(), stop=None))
    assert [g.ids for g in got] == [w.ids for w in want]
    err = capsys.readouterr().err
    assert "resident 0 blocks" in err and "4 blocks stream" in err and "peak RSS growth" in err
    assert not prefetch_threads()


@pytest.mark.parametrize("offload, limit, message", [
    ("disk", None, "--offload disk needs --memory-limit"),
    ("none", "1GiB", "add --offload disk"),
    ("disk", "lots", "--memory-limit: 'lots' is not a size"),
])
def test_offload_settings_refused_clearly(offload, limit, message):
    with pytest.raises(ConfigError, match=message):
        check_offload(offload, limit)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_offload_cpu_refused_without_cuda():
    with pytest.raises(ConfigError, match="use --offload disk"):
        check_offload("cpu", "1GiB")


def test_cli_offload_disk_prints_what_in_memory_prints(folder, capsys):
    """Greedy fp32 through `paratrain generate`: the same text with and without streaming (the
    in-memory sampler recomputes the whole sequence, the streamed one uses the cache: 1e-7 apart,
    far from a tie on this model)."""
    base = ["generate", "def ", "--init-from", str(folder), "--greedy", "--tokens", "6"]
    assert cli.main(base) == 0
    want = capsys.readouterr().out
    limit = str(probe(folder, torch.float32).minimum)
    assert cli.main(base + ["--offload", "disk", "--memory-limit", limit]) == 0
    got = capsys.readouterr()
    assert got.out == want and re.search(r"resident [0-3] blocks .* [1-4] blocks stream", got.err)


@pytest.mark.parametrize("extra, message", [
    (["--offload", "disk", "--memory-limit", "1MB"], "below the minimum of"),
    (["--memory-limit", "1GiB"], "add --offload disk"),
    (["--offload", "disk"], "needs --memory-limit"),
])
def test_cli_bad_offload_exits_2(folder, capsys, extra, message):
    assert cli.main(["generate", "def ", "--init-from", str(folder), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not prefetch_threads()


def test_run_folder_of_another_family_streams_equal(tmp_path):
    """A run's model.safetensors (RunWeights) of GPT-2 (learned positions, LayerNorm biases, a tied
    head stored once): streamed equals in memory, float64, bit for bit."""
    cfg = GPT2Config(vocab_size=64, dim=32, n_layers=3, n_heads=4, ffn_dim=64, max_seq_len=32)
    torch.manual_seed(0)
    model = build_model(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    save_file({k: v.float().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "run.json").write_text(json.dumps({"model": asdict(cfg)}))
    (tmp_path / "tokenizer.json").write_text("{}")
    model.load_state_dict({k: v.double() for k, v in load_file(str(tmp_path / "model.safetensors")).items()},
                          strict=False)
    want = decode(local_step(model), PROMPTS, GREEDY)
    plan = lambda m: plan_memory(m, 0, batch=3, prompt=7, capacity=13, dtype=torch.float64)  # noqa: E731
    with pytest.raises(MemoryLimitError, match="minimum of (\\d+) bytes") as refused:
        StreamedModel(RunWeights(str(tmp_path)), plan, offload="disk", dtype=torch.float64)
    minimum = int(re.search(r"minimum of (\d+) bytes", str(refused.value)).group(1))
    plan = lambda m: plan_memory(m, minimum, batch=3, prompt=7, capacity=13, dtype=torch.float64)  # noqa: E731
    with StreamedModel(RunWeights(str(tmp_path)), plan, offload="disk", dtype=torch.float64) as sm:
        assert len(sm.plan.streamed) == 3
        got = decode(streamed_step(sm), PROMPTS, GREEDY)
    assert [g.ids for g in got] == [w.ids for w in want]


@pytest.mark.parametrize("family", ["qwen2", "mixtral"])
def test_other_families_stream_equal(family, tmp_path):
    """q/k/v biases (Qwen2) and a dropless mixture of experts (Mixtral) stream like Llama."""
    save_hf(tmp_path, family, num_hidden_layers=3, tokenizer=False)
    want, want_logits = reference(tmp_path)
    got, logits, sm = streamed(tmp_path, "disk", probe(tmp_path).minimum)
    assert len(sm.plan.streamed) == 3
    assert [g.ids for g in got] == [w.ids for w in want]
    assert all(torch.equal(a, b) for a, b in zip(logits, want_logits))


def _block_folders(base: Path) -> list[Path]:
    return sorted(base.glob("paratrain-blocks-*"))


def test_offload_dir_holds_the_users_files_untouched(folder, tmp_path):
    """--offload-dir is the user's folder: the blocks go in a subfolder paratrain makes (and
    removes); the user's own block_1.bin / block_5.bin are neither overwritten nor deleted."""
    off = tmp_path / "off"
    off.mkdir()
    mine = {"block_1.bin": b"my own bytes", "block_5.bin": b"mine too", "paratrain-blocks-notes": b"x"}
    for name, data in mine.items():
        (off / name).write_bytes(data)
    _, _, sm = streamed(folder, "disk", probe(folder).minimum, offload_dir=str(off))
    assert sm.plan.streamed == ("0", "1", "2", "3") and sm.folder.parent == off
    assert sm.folder.name.startswith(f"paratrain-blocks-{os.getpid()}-") and not sm.folder.exists()
    assert {p.name: p.read_bytes() for p in off.iterdir()} == mine


def test_stale_block_folders_of_dead_processes_are_removed_at_the_next_start(folder, tmp_path):
    """A SIGKILLed generate leaves its block folder; the next start on this host removes it (only
    what paratrain wrote there), and leaves a live process's, another host's and unmarked ones."""
    import socket

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid, host = int(dead.stdout), socket.gethostname()
    off = tmp_path / "off"
    owners = {"dead": (host, dead_pid), "dead-user-file": (host, dead_pid), "live": (host, os.getpid()),
              "other-host": (host + "-elsewhere", dead_pid), "unmarked": None}
    for name, owner in owners.items():
        (off / f"paratrain-blocks-{name}").mkdir(parents=True)
        (off / f"paratrain-blocks-{name}" / "block_1.bin").write_bytes(b"blocks")
        if owner is not None:
            (off / f"paratrain-blocks-{name}" / "owner.json").write_text(json.dumps({"host": owner[0],
                                                                                    "pid": owner[1]}))
    (off / "paratrain-blocks-dead-user-file" / "notes.txt").write_text("the user's")
    streamed(folder, "disk", probe(folder).minimum, offload_dir=str(off))
    left = {p.name: sorted(f.name for f in p.iterdir()) for p in _block_folders(off)}
    assert left == {"paratrain-blocks-dead-user-file": ["notes.txt"],
                    "paratrain-blocks-live": ["block_1.bin", "owner.json"],
                    "paratrain-blocks-other-host": ["block_1.bin", "owner.json"],
                    "paratrain-blocks-unmarked": ["block_1.bin"]}


SIGTERM_CHILD = """
import sys, time
import paratrain.inference.stream_command as sc
def waiting(sm):  # the blocks are written: wait here, in generation, for the signal
    print("ready", flush=True)
    time.sleep(120)
sc.streamed_step = waiting
from paratrain import cli
sys.exit(cli.main(["generate", "def ", "--init-from", sys.argv[1], "--offload", "disk", "--memory-limit",
                   sys.argv[2], "--offload-dir", sys.argv[3], "--tokens", "2"]))
"""


def test_sigterm_during_generate_removes_its_block_folder(folder, tmp_path):
    import signal

    off = tmp_path / "off"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    limit = str(probe(folder, torch.float32).minimum)
    child = subprocess.Popen([sys.executable, "-c", SIGTERM_CHILD, str(folder), limit, str(off)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        assert len(_block_folders(off)) == 1 and list(_block_folders(off)[0].glob("block_*.bin"))
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=60)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 128 + signal.SIGTERM and not _block_folders(off)
    assert off.is_dir()  # the user's folder stays
