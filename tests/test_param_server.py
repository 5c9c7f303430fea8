"""The parameter server (--sync parameter-server) against one process, its staleness bound, its failures.

Tolerances. In sync mode a server adds the workers' gradients (each its share of the global mean)
in worker order, where one process sums all rows in one matmul: the same numbers added in another
order, ~1e-7 relative per sum in fp32, exactly the data-parallel situation of
tests/test_data_parallel.py. The servers run torch's AdamW per tensor, as one process does, on the
same fp32 values. So losses and weights are compared with the harness's FP32_REORDERED criterion
(isolated AdamW sign flips of near-zero gradients allowed, tests/harness.py), and the gradient
norm of every step too (AdamW would hide a wrong gradient scale, e.g. a mean of the shares instead
of their sum: that halves the norm, far beyond 2e-5).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from paratrain import config
from paratrain.cli import main
from paratrain.config import ConfigError
from paratrain.engine import checks
from paratrain.faults import HANG_SERVER_AT, KILL_SERVER_AT, PAUSE_AT_STEP, PAUSE_DIR
from paratrain.param_server.placement import assign, loads
from paratrain.param_server.server import ParamServer, Sequencer
from paratrain.param_server.session import ServerLoop
from paratrain.param_server.wire import Header, Kind, ProtocolError, receive_payload
from paratrain.train.ps_run import ps_world, rank_names, train_or_serve
from paratrain.train.task import build_task
from paratrain.train.trainer import Trainer, lr_at
from tests import netprobe
from tests.dist import WorkerError, run
from tests.harness import FP32_REORDERED, assert_same_weights, tiny_cfg
from tests.test_masked_loss_layouts import SEQ, PackedTask

GLOBAL_BATCH = 8
ROOT = Path(__file__).resolve().parents[1]
# tests/harness.py's TINY as flags (the torchrun test runs the command line)
TINY_CLI = ["--model", "tiny", "--vocab-size", "512", "--max-files", "40", "--seq-len", "32", "--steps", "4",
            "--global-batch", str(GLOBAL_BATCH), "--eval-every", "0", "--no-progress", "--warmup-steps", "1",
            "--lr", "1e-2", "--threads", "1"]


def _rank(env, cfg_dict: dict, environ: dict | None = None, packed: bool = False):
    os.environ.update(environ or {})  # workers fork from a server started earlier: not our environment
    cfg = config.Config.from_dict(cfg_dict)
    result = train_or_serve(cfg, env, task=PackedTask(cfg) if packed else None)
    return None if result is None else (result.losses, result.final_state)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _ps_cfg(out: Path, dp: int, servers: int, **overrides) -> config.Config:
    return tiny_cfg(out, **{"train.global_batch": GLOBAL_BATCH, "parallel.sync": "parameter-server",
                            "parallel.dp": dp, "parallel.servers": servers, **overrides})


def _train_ps(cfg: config.Config, timeout: float = 60.0, environ: dict | None = None,
              packed: bool = False) -> tuple[list[float], dict]:
    """Run dp x tp worker ranks + servers; return rank 0's losses and final weights (the servers'
    values). ``packed``: on tests/test_masked_loss_layouts.py's packed rows."""
    checks.validate(cfg)
    if not packed:
        build_task(cfg)  # tokenize once here; workers map the cache
    n_workers = cfg.world_size - cfg.ps_servers  # dp x tp ranks
    outs = run(_rank, cfg.world_size, cfg.to_dict(), environ, packed, timeout=timeout, group_size=n_workers,
               rank_names=rank_names(cfg))
    workers, servers = outs[:n_workers], outs[n_workers:]
    assert servers == [None] * cfg.ps_servers
    losses, weights = workers[0]
    assert all(w[0] == losses for w in workers), "workers disagree on the loss"
    return losses, weights


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("one_process")
    result = Trainer(tiny_cfg(out, **{"train.global_batch": GLOBAL_BATCH})).fit()
    return {"losses": result.losses, "weights": result.final_state, "rows": _rows(out)}


def assert_equals_one_process(out: Path, losses: list[float], weights: dict, reference: dict) -> None:
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference["losses"]), **FP32_REORDERED)
    assert_same_weights(weights, reference["weights"], **FP32_REORDERED)
    rows = _rows(out)
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in rows]),
                               torch.tensor([r["grad_norm"] for r in reference["rows"]]), rtol=2e-5, atol=0)
    n_bytes = 4 * rows[0]["n_params"]  # every worker pushes one fp32 gradient per step, and pulls the values
    assert all(r["comm_bytes"]["send"] == n_bytes and r["ps_pull_bytes"] == n_bytes for r in rows), rows[0]
    assert all(r["mem_optim_bytes"] == 0 for r in rows), "the servers hold the optimizer state"


def _run_probed(args: list[str], out: Path, tmp_path: Path, skip: int = 0) -> tuple[str, list]:
    """Run a parameter-server command; while it is held after step 2, a foreign process sends
    every TCP port of the job's processes (below the launcher ``skip`` levels down) an HTTP
    request, pickles that would create a marker file, and garbage. Returns the run's stderr and
    the listeners probed; the run must exit 0 and nothing may have run the pickles."""
    marker, pause = tmp_path / "marker", tmp_path / "pause"
    pause.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", PAUSE_AT_STEP: "2",
           PAUSE_DIR: str(pause)}
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:  # a file, not a pipe nobody reads while the run is held
        proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 180
        while not (pause / "paused").exists():
            assert proc.poll() is None, f"the run ended before step 2: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the run did not reach step 2 within 180 s"
            time.sleep(0.1)
        listeners = [(pid, *where) for pid in netprobe.descendants(proc.pid)[skip:]
                     for where in netprobe.listening(pid)]
        for pid, address, port in listeners:
            reached = [netprobe.send_to(address, port, data) for data in netprobe.payloads(str(marker))]
            assert reached[0], f"process {pid} listens on {address}:{port} but refused a connection"
        (pause / "go").touch()
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = log.read_text()
    assert proc.returncode == 0, err[-3000:]
    assert not marker.exists(), "a foreign process's pickle ran in the job"
    return err, listeners


@pytest.mark.composes(("param-server",))
def test_torchrun_start_equals_one_process(tmp_path, reference):
    """Sync mode, 2 workers + 1 server, equals one process. Started by torchrun: its world is the
    workers then the servers, 3 ranks. (2 workers + 2 servers under paratrain's own launcher: the
    resume test's unbroken run; the two launchers give bit-identical weights, checked by hand.)
    Probed by a foreign process while it runs (``_run_probed``): on one host (MASTER_ADDR=localhost)
    the ranks listen on loopback only, and the run is unharmed. torchrun's agent, whose store is
    torchrun's, is not probed."""
    out = tmp_path / "run"
    args = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "3",
            "-m", "paratrain.cli", "train", *TINY_CLI, "--sync", "parameter-server", "--dp", "2",
            "--servers", "1", "--out", str(out)]
    _, listeners = _run_probed(args, out, tmp_path, skip=1)
    assert listeners and all(netprobe.is_loopback(address) for _, address, _ in listeners), listeners
    losses = [r["loss"] for r in _rows(out)]
    assert_equals_one_process(out, losses, load_file(str(out / "model.safetensors")), reference)


def test_foreign_peer_runs_no_code_and_stops_nothing(tmp_path, reference):
    """Issue 35 item 11: the servers unpickled and called what a connection sent (torch RPC), and
    an HTTP request crashed one (std::bad_alloc). Now workers and servers exchange tensors over
    gloo, every rank's one listener is on loopback (paratrain's launcher), a stranger's bytes
    are never read as a message, and the run finishes equal to one process, without warnings
    (item 7: RPC's start-up printed three torch UserWarnings)."""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "paratrain.cli", "train", *TINY_CLI, "--sync", "parameter-server",
            "--nproc", "3", "--dp", "2", "--servers", "1", "--out", str(out)]
    err, listeners = _run_probed(args, out, tmp_path)
    assert len({pid for pid, _, _ in listeners}) >= 3, listeners  # every rank listens: all were probed
    assert all(netprobe.is_loopback(address) for _, address, _ in listeners), listeners
    assert "Warning" not in err, err
    losses = [r["loss"] for r in _rows(out)]
    assert_equals_one_process(out, losses, load_file(str(out / "model.safetensors")), reference)


def test_nothing_imports_torch_rpc():
    """The parameter server's transport is the run's gloo group: no module of paratrain imports
    torch.distributed.rpc, whose calls are pickled callables."""
    def imports_rpc(node: ast.AST) -> bool:
        if isinstance(node, ast.Import):
            return any(a.name.startswith("torch.distributed.rpc") for a in node.names)
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            return module.startswith("torch.distributed.rpc") or (
                module == "torch.distributed" and any(a.name == "rpc" for a in node.names))
        return False

    files = list((ROOT / "paratrain").rglob("*.py"))
    assert len(files) > 50
    users = [str(f.relative_to(ROOT)) for f in files
             if any(imports_rpc(node) for node in ast.walk(ast.parse(f.read_text())))]
    assert users == [], users


def test_placement_is_balanced_and_deterministic():
    sizes = {"emb": 1000, "a": 300, "b": 300, "c": 200, "d": 200, "norm": 10}
    owner = assign(sizes, 2)
    assert owner == assign(dict(reversed(sizes.items())), 2)  # independent of the order given
    assert loads(owner, sizes, 2) == [1010, 1000]  # emb | a b c d, then norm to the first of equals
    assert set(assign(sizes, 3).values()) == {0, 1, 2}


@pytest.mark.parametrize("fault, named", [
    (KILL_SERVER_AT, "rank 2 (server0) died"),  # the launcher sees it die
    (HANG_SERVER_AT, ") failed:\nServerError: parameter server server0 (rank 2) failed, died or did not "
                     "answer within 3 s"),  # a worker, "rank 0 (worker0)" or 1, reports it
])
def test_server_failure_is_named(tmp_path, fault, named):
    """Killed or hung after its second update, the server ends the run, named, within the timeout
    (3 s here; the launcher's own timeout is far longer, so it is the RPC timeout that fired)."""
    cfg = _ps_cfg(tmp_path, dp=2, servers=1, **{"parallel.timeout_s": 3.0})
    with pytest.raises(WorkerError) as err:
        _train_ps(cfg, timeout=60, environ={fault: "2"})
    assert named in str(err.value), str(err.value)


@pytest.mark.parametrize("overrides, fragment", [
    ({"parallel.zero": 1}, "--zero 0"),
    ({"parallel.dp_replicate": 2}, "no --dp-replicate / --dp-shard"),
    ({"parallel.ps_mode": "async", "parallel.max_staleness": 0}, "below dp - 1"),
    ({"parallel.nproc": 4}, "server(s) = 3 != world size 4"),
])
def test_bad_settings_are_refused(tmp_path, overrides, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        checks.validate(_ps_cfg(tmp_path, dp=2, servers=1, **overrides))


def test_shared_memory_sum_with_the_parameter_server_is_refused_not_ignored(tmp_path):
    """--dp-reduce shm with --sync parameter-server was silently ignored: the servers sum the
    workers' gradients and the workers run no DDP. Refused before any worker starts, naming the flag."""
    cfg = _ps_cfg(tmp_path, dp=2, servers=1, **{"parallel.dp_reduce": "shm"})
    refused = "--dp-reduce shm sums DDP's buckets, and --sync parameter-server runs no DDP"
    with pytest.raises(ConfigError, match=refused):
        checks.validate(cfg)


def test_server_flags_need_the_parameter_server(tmp_path):
    with pytest.raises(ConfigError, match="--servers applies to --sync parameter-server only"):
        checks.validate(tiny_cfg(tmp_path, **{"parallel.servers": 2}))


def test_cli_bad_flags_exit_2(tmp_path, capsys):
    args = ["train", "--model", "tiny", "--sync", "parameter-server", "--nproc", "3", "--dp", "2"]
    assert main([*args, "--ps-mode", "later", "--out", str(tmp_path / "a")]) == 2
    assert "parallel.ps_mode = 'later' is not one of sync, async" in capsys.readouterr().err
    assert main([*args, "--servers", "2", "--out", str(tmp_path / "b")]) == 2
    assert "server(s) = 4 != world size 3" in capsys.readouterr().err
    assert not (tmp_path / "a").exists(), "refused before anything was written"


# A worker's compute in another form: the servers see only the trainable parameters' fp32 gradients
# (LoRA: the adapters'; the frozen base, fp32, bf16 or nf4, never leaves the workers) and keep fp32
# values (bf16: autocast over fp32 weights, mixed precision's normal form). Two steps each: the
# second is the first the servers' AdamW takes from moments it kept.
LORA = {"lora.rank": 4, "lora.alpha": 8.0, "train.steps": 2}
# the "lora" form trains on packed rows with loss masks (tests/test_masked_loss_layouts.py's task, its
# 16-token rows): each worker's gradient is its rows' share of the global batch's counted targets
PACKED = {"data.seq_len": SEQ}
WORKER_FORMS = {"lora": {**LORA, **PACKED},
                "lora-bf16-base-bf16": {**LORA, "lora.base_precision": "bf16", "train.precision": "bf16"},
                "qlora-nf4": {**LORA, "lora.base_precision": "nf4"}}
# bf16 autocast: the process and a worker run the same rows through bf16 matmuls whose kernels may
# block a 4-row micro-batch differently: measured up to 1e-3 on weights of ~1e-2 after 4 steps;
# a worker's lost or doubled gradient moves every element by ~lr = 1e-2 and its norm 2x.
BF16_TOL = {"rtol": 1e-2, "atol": 5e-3}


@pytest.mark.composes(("param-server", "bf16"), ("param-server", "lora"), ("param-server", "lora-bf16"),
                      ("param-server", "qlora"))
@pytest.mark.composes(("param-server", "lora", "packing"), case="lora")
@pytest.mark.parametrize("form", WORKER_FORMS, ids=list(WORKER_FORMS))
def test_worker_forms_equal_one_process(tmp_path, form):
    """2 workers + 1 server vs one process on micro-batches of the workers' rows (4 of the 8): each
    worker's gradient is the process's micro-batch gradient (the same rows, the same autocast), the
    server adds the two in the order the process accumulates them, and its AdamW steps the same
    values. The pushed and pulled bytes are the adapters' alone, and the export holds the unchanged
    frozen base (written by worker 0: no server holds it)."""
    extra = WORKER_FORMS[form]
    tol = BF16_TOL if extra.get("train.precision") == "bf16" else FP32_REORDERED
    one_out = tmp_path / "one"
    batches = {"train.global_batch": GLOBAL_BATCH, "train.micro_batch": 4}
    packed = extra.items() >= PACKED.items()
    one_cfg = tiny_cfg(one_out, **batches, **extra)
    one = Trainer(one_cfg, task=PackedTask(one_cfg) if packed else None).fit()
    out = tmp_path / "ps"
    losses, weights = _train_ps(_ps_cfg(out, dp=2, servers=1, **extra), packed=packed)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one.losses), **tol)
    assert_same_weights(weights, one.final_state, **tol)
    rows, ref_rows = _rows(out), _rows(one_out)
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in rows]),
                               torch.tensor([r["grad_norm"] for r in ref_rows]), rtol=tol["rtol"], atol=0)
    trainable = 4 * rows[0]["n_trainable_params"]
    assert trainable < rows[0]["n_params"]
    assert all(r["comm_bytes"]["send"] == trainable == r["ps_pull_bytes"] for r in rows), rows[0]


@pytest.mark.composes(("param-server", "8bit"))
def test_servers_run_8bit_adamw_and_resume_its_state_exactly(tmp_path):
    """--optimizer adamw8bit: each server runs the 8-bit AdamW on its whole tensors (the blocks one
    process cuts) and equals one process on the workers' micro-batches; its codes and block scales
    travel as data (fp32 on the wire, uint8 in the checkpoint, as one process writes them) and a
    resume from step 2 under the servers is bit for bit the unbroken run."""
    eight = {"optim.name": "adamw8bit", "train.save_every": 2}
    one = Trainer(tiny_cfg(tmp_path / "one", **{"train.global_batch": GLOBAL_BATCH, "train.micro_batch": 4},
                           **eight)).fit()
    unbroken = tmp_path / "unbroken"
    losses, weights = _train_ps(_ps_cfg(unbroken, dp=2, servers=2, **eight))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one.losses), **FP32_REORDERED)
    assert_same_weights(weights, one.final_state, **FP32_REORDERED)
    index = json.loads((unbroken / "checkpoints" / "step_000002" / "index.json").read_text())["tensors"]
    assert {"exp_avg.q", "exp_avg_sq.absmax"} <= set(index["layers.0.attn.wq.weight"])  # 4096: quantised
    assert {"exp_avg", "exp_avg_sq"} <= set(index["layers.0.attn_norm.weight"])  # small: fp32 moments
    _continue_from(unbroken, tmp_path / "resumed")
    again, weights_again = _train_ps(_ps_cfg(tmp_path / "resumed", dp=2, servers=2,
                                             **{**eight, "train.resume": True}))
    assert again == losses[2:]
    assert_same_weights(weights_again, weights, rtol=0, atol=0)


# A worker split over ranks: 2 workers x (tp 2 with sequence parallelism | pp 2 under 1F1B) + 1
# server = 5 ranks, or 2 workers of one ep group (each rank half the experts) + 1 server, against
# one process on the same micro-batches (pp: 2 per worker, else 1).
MOE = {"model.name": "tiny-moe", "model.aux_loss_coef": 0.1, "model.z_loss_coef": 0.01, "optim.eps": 1e-5}
# Savers that must not change the mathematics, switched on in the workers only (the process runs
# without them): compiled blocks (AOT autograd, the same fp32 kernels), token tiles of the head's
# loss, activations offloaded to the CPU between forward and backward.
COMPILE = {"train.compile": True, "train.compile_backend": "aot_eager"}
TILE_ACT_OFFLOAD = {"train.tile": 2, "train.offload_activations": "cpu"}
WORKERS_ONLY = {*COMPILE, *TILE_ACT_OFFLOAD}
# tp2-sp also runs the servers' 8-bit AdamW on the tp slices, in blocks of 64: a row-parallel slice's
# are 4 elements, cut along the full tensor's 16 pieces (cut as the slice's own they would be 2), and
# the quantise decision reads the full size (a 64 x 64 weight's 2048-element slice is quantised).
SPLIT_WORKERS = {"tp2-sp": {"parallel.tp": 2, "parallel.sp": True, "train.micro_batch": 4,
                            "optim.name": "adamw8bit", "optim.block_size": 64},
                 "pp2-1f1b": {"parallel.pp": 2, "parallel.pp_schedule": "1f1b", "train.micro_batch": 2,
                              # the attention core recomputed inside each compiled block (a fully
                              # recomputed block runs eager under --compile: docs/memory.md)
                              "train.recompute": "selective", **COMPILE},
                 "ep2-moe": {"parallel.ep": 2, "train.micro_batch": 4, **MOE, **TILE_ACT_OFFLOAD}}


@pytest.mark.composes(("param-server", "8bit", "tp"), ("param-server", "sp"), case="tp2-sp")
@pytest.mark.composes(("param-server", "1f1b", "recompute", "compile"), case="pp2-1f1b")
@pytest.mark.composes(("param-server", "ep", "moe", "tiling", "act-offload"), case="ep2-moe")
@pytest.mark.parametrize("layout", SPLIT_WORKERS, ids=list(SPLIT_WORKERS))
def test_split_workers_equal_one_process(tmp_path, layout):
    """Each (stage, tp index) is its own shard group on the server: that rank of both workers
    pushes its slices, summed in worker order, stepped by the server's AdamW. A tensor two ranks
    of a worker hold (the norms' weights on every tp rank, their partial gradients summed over tp
    by the f operator under SP; the tied embedding on the first and last stage) counts once in the
    clip norm (ep: a shard group is one ep index's workers, an expert's edp ranks; the dense
    gradients are summed over the ep group before the push, so each group's sum is the dp sum),
    which must equal the process's (counted twice, or a slice missed, it moves far beyond 2e-5);
    the export is the full model, from the servers' slices."""
    extra = {"train.global_batch": GLOBAL_BATCH, "train.steps": 2, **SPLIT_WORKERS[layout]}
    one_out = tmp_path / "one"
    same_model = {k: v for k, v in extra.items() if not k.startswith("parallel.") and k not in WORKERS_ONLY}
    one = Trainer(tiny_cfg(one_out, **same_model)).fit()
    out = tmp_path / "ps"
    losses, weights = _train_ps(_ps_cfg(out, dp=2, servers=1, **extra))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one.losses), **FP32_REORDERED)
    assert_same_weights(weights, one.final_state, **FP32_REORDERED)
    rows, ref_rows = _rows(out), _rows(one_out)
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in rows]),
                               torch.tensor([r["grad_norm"] for r in ref_rows]), rtol=2e-5, atol=0)
    assert all(r["mem_optim_bytes"] == 0 for r in rows), "the servers hold the optimizer state"
    if "train.offload_activations" in extra:  # a setting the workers silently ignored would pass parity
        assert all(r["mem_activations_offloaded_bytes"] > 0 for r in rows)


def _replay_async(cfg: config.Config, tickets: list[list[int]], norms: dict | None = None
                  ) -> tuple[list[float], dict]:
    """One process applying a recorded sequence of async updates (``tickets[s][w]``: the place of
    worker w's update of step s): each update is worker w's gradient on its rows of step s,
    computed on the values it last read (after its previous update, or the initial ones), times
    dp (client.py: its rows' mean gradient), clipped, then AdamW on the values current at that
    place. Returns the summed loss of each step (the workers' shares, as logged) and the weights;
    ``norms``, if given, receives each update's clip norm by (step, worker)."""
    trainer, (dp, steps) = Trainer(cfg), (len(tickets[0]), len(tickets))
    strategy, params = trainer.engine.strategy, dict(trainer.engine.model.named_parameters())
    rows = cfg.train.global_batch // dp
    history = {0: {n: p.detach().clone() for n, p in params.items()}}  # values by version
    losses, read = [0.0] * steps, [0] * dp
    for ticket, w, s in sorted((tickets[s][w], w, s) for s in range(steps) for w in range(dp)):
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(history[read[w]][n])
        trainer.local_rows = lambda w=w: slice(w * rows, (w + 1) * rows)
        x, y, positions = trainer.task_batch(s)
        batches = trainer.micro_batches(x, y, positions)
        losses[s] += float(trainer.engine.executor.run(batches, float(trainer.counted(s)), 1.0))
        strategy.scale_grads(float(dp))
        norm = strategy.grad_norm()
        if norms is not None:
            norms[s, w] = norm
        trainer.engine.clip_grads(norm, cfg.optim.grad_clip or float("inf"))
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(history[ticket][n])
        strategy.step(lr_at(s, cfg))
        strategy.zero_grad()
        history[ticket + 1] = {n: p.detach().clone() for n, p in params.items()}
        read[w] = ticket + 1
    return losses, history[steps * dp]


@pytest.mark.composes(("param-server", "tp"), ("param-server", "batch-finder"))
def test_async_split_workers_equal_one_process_applying_their_order(tmp_path):
    """Async mode with workers split over tp ranks (issue 37): 2 workers of tp 2 + 2 servers. Each
    rank asks server 0 for its update's ticket (granted once both ranks of the worker asked, within
    the staleness bound S = dp - 1 = 1) and every shard group of both servers applies the pushes in
    ticket order: both ranks of a worker report the same ticket, and the run equals one process
    applying that recorded sequence of updates (``_replay_async``; a slice applied in another
    order, or a clip norm with a tp copy counted twice, moves the weights far beyond
    FP32_REORDERED; replayed without the staleness, on the latest values, the losses miss by 5 %).
    --micro-batch auto: the trials run forward + backward on the workers alone, nothing pushed,
    and the replay runs the micro-batch it chose, set by hand."""
    out, steps = tmp_path / "ps", {"train.global_batch": GLOBAL_BATCH, "train.steps": 3}
    losses, weights = _train_ps(_ps_cfg(out, dp=2, servers=2, **steps, **{
        "parallel.tp": 2, "parallel.ps_mode": "async", "train.micro_batch": "auto",
        "train.memory_limit": 2 ** 40}))
    rows = _rows(out)
    staleness = [s for r in rows for s in r["per_rank"]["ps_staleness"]]  # every rank's every update
    assert max(staleness) == 1 == rows[-1]["ps_staleness_max"], staleness  # two workers pushing each step
    assert [r["ps_staleness"] for r in rows] == [max(r["per_rank"]["ps_staleness"]) for r in rows]
    by_rank = [r["per_rank"]["ps_ticket"] for r in rows]  # worker ranks 0, 1 | 2, 3 (tp fastest)
    assert all(t[0] == t[1] and t[2] == t[3] for t in by_rank), by_rank
    tickets = [[t[0], t[2]] for t in by_rank]
    assert sorted(sum(tickets, [])) == list(range(6)), tickets
    chosen = rows[0]["batch_finder"]["chosen"]
    one_cfg = tiny_cfg(tmp_path / "one", **steps, **{"train.micro_batch": chosen})
    one_losses, one_weights = _replay_async(one_cfg, tickets)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one_losses), **FP32_REORDERED)
    assert_same_weights(weights, one_weights, **FP32_REORDERED)


def _continue_from(src: Path, dst: Path, step: int = 2) -> None:
    """A fresh run folder holding only checkpoint ``step`` of ``src`` (what a crash would leave)."""
    name = f"step_{step:06d}"
    shutil.copytree(src / "checkpoints" / name, dst / "checkpoints" / name)
    (dst / "checkpoints" / "latest").write_text(name + "\n")


def test_resume_continues_exactly_and_loads_in_another_layout(tmp_path, reference):
    """The checkpoint holds the servers' values and AdamW moments: resumed from step 2 under the
    parameter server, steps 3-4 are bit for bit the unbroken run's (same sums in the same order);
    resumed in one process they match the one-process run (FP32_REORDERED: the first two steps
    were summed over workers)."""
    unbroken = tmp_path / "unbroken"
    cfg = _ps_cfg(unbroken, dp=2, servers=2, **{"train.save_every": 2})
    losses, weights = _train_ps(cfg)
    assert_equals_one_process(unbroken, losses, weights, reference)
    index = json.loads((unbroken / "checkpoints" / "step_000002" / "index.json").read_text())
    assert any("exp_avg_sq" in str(entry) for entry in index.values()), "the servers' AdamW state is saved"
    _continue_from(unbroken, tmp_path / "resumed")
    resumed = _ps_cfg(tmp_path / "resumed", dp=2, servers=2, **{"train.resume": True})
    again, weights_again = _train_ps(resumed)
    assert again == losses[2:]
    assert_same_weights(weights_again, weights, rtol=0, atol=0)
    _continue_from(unbroken, tmp_path / "one")
    one_cfg = tiny_cfg(tmp_path / "one", **{"train.global_batch": GLOBAL_BATCH, "train.resume": True})
    one = Trainer(one_cfg).fit()
    torch.testing.assert_close(torch.tensor(one.losses), torch.tensor(reference["losses"][2:]),
                               **FP32_REORDERED)
    assert_same_weights(one.final_state, reference["weights"], **FP32_REORDERED)


# --------------------------------------------------------------------------------------------
# The server's rules, on one ParamServer in this process (no RPC): orders chosen, not raced
# --------------------------------------------------------------------------------------------

ADAMW = {"lr": 0.1, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}


def test_async_gate_holds_a_ticket_that_would_leave_a_worker_too_far_behind():
    seq = Sequencer(3, 1, max_staleness=2)
    first = [seq.ask(w) for w in (0, 1, 2)]  # tickets 0, 1, 2: worker w reads version w + 1
    assert [f.wait() for f in first] == [(0, 0), (1, 1), (2, 2)]
    # Now in reverse. Granting worker 2 (version 3 -> 4) would leave worker 0, which read
    # version 1, 3 updates behind: held; worker 1 too. Without the gate worker 0's next update
    # would be 4 updates late.
    late2, late1 = seq.ask(2), seq.ask(1)
    assert not late2.done() and not late1.done()
    late0 = seq.ask(0)  # the oldest reader: granted, then the held ones, oldest first
    assert [late0.wait(), late1.wait(), late2.wait()] == [(3, 2), (4, 2), (5, 2)]
    assert seq.version == 6


def test_async_gate_ignores_finished_workers():
    seq = Sequencer(2, 1, max_staleness=1)
    seq.finish(1)  # worker 1 never asks again: it must not hold worker 0 back
    assert [seq.ask(0).wait()[1] for _ in range(3)] == [0, 0, 0]


def test_an_async_worker_is_a_cp_group_whose_cp_index_0_alone_talks(tmp_path):
    """Async mode under cp (issue 37): dp 2 x cp 2 x tp 2 is 2 workers to the servers, each of 4
    ranks, and only cp index 0 of a worker talks to them (a message from its cp peer breaks the
    protocol); sync mode keeps every cp rank a worker of its own (4 per shard group)."""
    layout = {"parallel.sync": "parameter-server", "parallel.cp": 2, "parallel.tp": 2, "parallel.dp": 2}
    world = ps_world(tiny_cfg(tmp_path, **layout, **{"parallel.ps_mode": "async"}))
    assert (world.workers, world.group_workers, world.shard_groups) == (8, 2, 2)
    # mesh.py: rank = dp index * tp + tp index, dp index = batch * cp + cp index
    assert [world.speaks(r) for r in range(8)] == [True, True, False, False] * 2
    assert [world.dp_index(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    loop = ServerLoop(None, world, [ParamServer(2, True) for _ in range(2)])
    with pytest.raises(ProtocolError, match="a cp rank whose worker's cp index 0 talks for it"):
        loop.handle(Header(Kind.FINISH, worker=2), 2)
    sync = ps_world(tiny_cfg(tmp_path, **layout))
    assert sync.group_workers == 4 and all(sync.speaks(r) for r in range(8))


def test_a_split_worker_gets_one_ticket_and_every_group_applies_tickets_in_order():
    """Issue 37: a worker of two ranks (two shard groups) is granted one ticket once both asked,
    and a ParamServer applies pushes in ticket order whatever order they arrive in: AdamW's
    update depends on it (the second step's moments hold the first's gradient)."""
    seq = Sequencer(2, 2, max_staleness=1)
    ask = seq.ask(1)
    assert not ask.done()  # one of worker 1's two ranks: not yet
    assert [seq.ask(1).wait(), ask.wait()] == [(0, 0), (0, 0)]
    zero = seq.ask(0)
    assert not zero.done() and seq.ask(0).wait() == zero.wait() == (1, 1)
    grads = [{"w": torch.tensor([1.0, -2.0, 3.0])}, {"w": torch.tensor([-5.0, 0.5, 0.25])}]
    in_order, reversed_ = ParamServer(2, True), ParamServer(2, True)
    for server in (in_order, reversed_):
        server.setup({"w": torch.zeros(3)}, ADAMW)
    answers = [in_order.push_async(w, grads[w], 0.1, ticket=w) for w in (0, 1)]
    late = reversed_.push_async(1, grads[1], 0.1, ticket=1)
    assert not late.done()  # ticket 0 not yet applied
    early = reversed_.push_async(0, grads[0], 0.1, ticket=0)
    assert [a.wait()[1:] for a in answers] == [early.wait()[1:], late.wait()[1:]] == [(0, 1), (1, 2)]
    assert torch.equal(late.wait()[0]["w"], answers[1].wait()[0]["w"])
    with pytest.raises(RuntimeError, match="ticket 1 pushed twice"):
        reversed_.push_async(1, grads[1], 0.1, ticket=1)


def test_sync_sum_does_not_depend_on_arrival_order():
    """fp32 addition is not associative: 1e8 + 1 - 1e8 is 0 in worker order, 1 in another."""
    parts = {0: torch.tensor([1e8]), 1: torch.tensor([1.0]), 2: torch.tensor([-1e8])}
    norms = []
    for order in ((0, 1, 2), (0, 2, 1), (2, 1, 0)):
        server = ParamServer(3, False)
        server.setup({"w": torch.zeros(1)}, ADAMW)
        futures = [server.push_sync(w, 0, {"w": parts[w]}) for w in order]
        norms.append(futures[0].wait())
    assert norms == [[0.0], [0.0], [0.0]], norms  # per tensor (one here): the worker ranks add them


@pytest.mark.parametrize("slots, fragment", [
    ([42, 0, 0, 0, 1, 0, 0, 0], "unknown message kind 42"),
    ([2, 0.5, 0, 0, 1, 0, 0, 0], "fractional"),
    ([2, 0, 0, 0, 1, 0, -1, 0], "out of bounds"),
    ([2, 0, 0, 0, 1, 0, 0, 2.0 ** 50], "out of bounds"),
    ([2, 0, float("nan"), 0, 1, 0, 0, 0], "non-finite"),
])
def test_a_malformed_header_is_refused_before_anything_is_allocated(slots, fragment):
    with pytest.raises(ProtocolError, match=fragment):
        Header.parse(torch.tensor(slots, dtype=torch.float64))


def test_a_header_round_trips_and_a_body_of_another_size_is_refused():
    header = Header(Kind.APPLY_SYNC, worker=1, round=7, lr=3e-4, factor=0.5, payload=12)
    assert Header.parse(header.tensor()) == header
    with pytest.raises(ProtocolError, match="APPLY_SYNC message of 12 elements, expected 10"):
        receive_payload(None, 2, header, 10, 1.0, reply=False)  # refused before any receive
