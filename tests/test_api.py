"""The library API (paratrain.Parallel): the user's own module, optimizer and loop.

Every layout is compared with one plain process running the same loop with plain torch (no
paratrain at all): losses every step and the final full weights, at the harness's fp32 tolerance
(FP32_REORDERED: gradients are summed over dp in another order, ~1e-7 relative per sum).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import paratrain
from paratrain.zero.recipe import NotElementwiseError
from tests.dist import run
from tests.harness import FP32_REORDERED

ROOT = Path(__file__).resolve().parents[1]
STEPS, BATCH, DIM = 4, 8, 16


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """Not a Llama: an input layer, a tree of residual MLP blocks, a LayerNorm + head, and a
    parameter owned by the root module itself."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, DIM)
        self.blocks = nn.ModuleList([Block(DIM), Block(DIM)])
        self.scale = nn.Parameter(torch.ones(DIM))
        self.head = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 4))

    def forward(self, x):
        h = self.inp(x) * self.scale
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":  # two groups, decay on matrices only: groups must survive sharding
        mats = [p for p in model.parameters() if p.dim() >= 2]
        vecs = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": mats, "weight_decay": 0.1}, {"params": vecs, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=3e-3)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.Adagrad(model.parameters(), lr=0.05)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)


def build(kind: str):
    torch.manual_seed(0)
    model = Net()
    opt = make_optimizer(kind, model)
    # A scheduler on the user's optimizer: the wrapped one must honour param_groups' lr each step.
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def reference(kind: str, steps: int = STEPS, clip: float | None = None) -> tuple[list[float], dict]:
    """One plain process, plain torch, the whole global batch."""
    model, opt, sched = build(kind)
    losses = []
    for k in range(steps):
        x, y = batch(k)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_steps(par, model, opt, sched, first: int, last: int, accum: int = 1,
                clip: float | None = None) -> list[float]:
    per_rank = BATCH // par.dp_size
    lo = par.dp_rank * per_rank
    losses = []
    for k in range(first, last):
        x, y = (t.to(par.device) for t in batch(k))  # the user's loop moves its data to par.device
        loss = 0.0
        for m in range(accum):  # micro-batches: all but the last under no_sync
            rows = slice(lo + m * per_rank // accum, lo + (m + 1) * per_rank // accum)
            micro = F.cross_entropy(model(x[rows]), y[rows]) / accum
            with par.no_sync() if m < accum - 1 else contextlib.nullcontext():
                par.backward(micro)
            loss += micro.detach()
        if clip is not None:
            par.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(_global_mean(loss.detach(), par))
    return losses


def _global_mean(loss: torch.Tensor, par) -> float:
    if par.dp_size > 1:
        loss = loss.clone()
        dist.all_reduce(loss, group=par.mesh.dp.group)
        loss /= par.dp_size
    return loss.item()


def _train_with(env, kinds: list[str], par_kwargs: dict, accum: int = 1, clip: float | None = None) -> dict:
    out = {}
    for kind in kinds:
        kw = dict(par_kwargs)
        if kw.get("offload_dir"):
            kw["offload_dir"] = f"{kw['offload_dir']}/{kind}"
        par = paratrain.Parallel(**kw)
        model, opt, sched = build(kind)
        model, opt = par.prepare(model, opt)
        losses = train_steps(par, model, opt, sched, 0, STEPS, accum=accum, clip=clip)
        out[kind] = (losses, par.full_state_dict(model))
    return out


def assert_same(got, ref) -> None:
    losses, weights = got
    ref_losses, ref_weights = ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **FP32_REORDERED)
    assert weights.keys() == ref_weights.keys()
    for name, w in ref_weights.items():
        torch.testing.assert_close(
            weights[name].cpu(), w, **FP32_REORDERED, msg=lambda m, n=name: f"{n}: {m}"
        )


KINDS = ["adamw", "sgd", "adagrad"]
# layout -> (Parallel arguments, optimizers, loop options): zero 0-3 with all three classes; the
# offload stores with the class whose state they must carry; accumulation and clipping on some.
# Layouts run in the same two workers, one after the other (a fresh Parallel each): worker start-up,
# not the tiny model, is what costs time here.
LAYOUTS = {
    "ddp": ({"zero": 0}, KINDS, {"clip": 0.5}),
    "plain": ({"zero": 0, "dp_mode": "plain"}, ["adamw"], {"accum": 2}),
    "zero1": ({"zero": 1}, KINDS, {"clip": 0.5}),
    "zero2": ({"zero": 2, "bucket_mb": 0.002}, KINDS, {"accum": 2}),  # several buckets: hooks mid-backward
    "zero3": ({"zero": 3}, KINDS, {"accum": 2, "clip": 0.5}),
    "zero3_units": ({"zero": 3, "units": ["blocks.0", "blocks.1.up", "head"]}, ["adamw"], {}),
}
OFFLOAD_LAYOUTS = {
    "zero1_cpu": ({"zero": 1, "offload": "cpu"}, ["sgd"], {}),
    "zero3_cpu": ({"zero": 3, "offload": "cpu"}, ["adamw"], {}),
    "zero2_disk": ({"zero": 2, "offload": "disk"}, ["adagrad", "sgd"], {}),
    "zero3_disk": ({"zero": 3, "offload": "disk"}, ["adamw"], {"clip": 0.5}),
}


def _train_layouts(env, layouts: dict, offload_dir: str) -> dict:
    out = {}
    for name, (kw, kinds, loop) in layouts.items():
        kw = {**kw, "offload_dir": f"{offload_dir}/{name}"} if kw.get("offload") == "disk" else kw
        for kind, result in _train_with(env, kinds, kw, **loop).items():
            out[name, kind] = result
    return out


def _check_layouts(layouts: dict, got: dict) -> None:
    refs: dict = {}
    for name, (_, kinds, loop) in layouts.items():
        for kind in kinds:
            key = (kind, loop.get("clip"))
            refs[key] = refs.get(key) or reference(kind, clip=loop.get("clip"))
            try:
                assert_same(got[name, kind], refs[key])
            except AssertionError as e:
                raise AssertionError(f"layout {name}, optimizer {kind}: {e}") from None


def test_dp_and_zero_stages_at_dp2_equal_one_process(tmp_path):
    _check_layouts(LAYOUTS, run(_train_layouts, 2, LAYOUTS, str(tmp_path), timeout=240)[0])


def test_offload_cpu_and_disk_at_dp2_equal_one_process(tmp_path):
    _check_layouts(OFFLOAD_LAYOUTS, run(_train_layouts, 2, OFFLOAD_LAYOUTS, str(tmp_path), timeout=240)[0])


def test_one_plain_process_zero3():
    """No process group at all: Parallel runs as world 1 (ZeRO-3 over one rank)."""
    got = _train_with(None, ["sgd"], {"zero": 3})
    assert_same(got["sgd"], reference("sgd"))


class TiedNet(nn.Module):
    """A user's language model with its head tied to the embedding: under the size policy the head
    is a unit that owns no parameter of its own (seen: an IndexError in FlatLayout.build)."""

    def __init__(self, vocab: int = 24):
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        self.blocks = nn.ModuleList([Block(DIM), Block(DIM)])
        self.head = nn.Linear(DIM, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _tied_steps(par) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = TiedNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if par is not None:
        model, opt = par.prepare(model, opt)
    rows = slice(None) if par is None else slice(par.dp_rank * BATCH // par.dp_size,
                                                 (par.dp_rank + 1) * BATCH // par.dp_size)
    losses = []
    for k in range(STEPS):
        ids = torch.randint(0, 24, (BATCH, 7), generator=torch.Generator().manual_seed(k))
        loss = F.cross_entropy(model(ids[rows, :-1]).flatten(0, 1), ids[rows, 1:].flatten())
        loss.backward() if par is None else par.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item() if par is None else _global_mean(loss.detach(), par))
    state = model.state_dict() if par is None else par.full_state_dict(model)
    return losses, {k: v.detach().clone() for k, v in state.items()}


def _train_tied_zero3(env) -> tuple:
    return _tied_steps(paratrain.Parallel(zero=3))


def test_zero3_user_model_with_a_tied_head_equals_one_process():
    from paratrain.zero.units import size_units

    # the head is a unit that owns nothing new
    assert [n for n, _ in size_units(TiedNet())] == ["embed", "blocks.0", "blocks.1", "head"]
    assert_same(run(_train_tied_zero3, 2, timeout=120)[0], _tied_steps(None))


def test_size_units_policy_stops_at_the_first_module_big_enough():
    from paratrain.models import build_model, preset
    from paratrain.zero.units import size_units

    assert [n for n, _ in size_units(Net())] == ["inp", "blocks.0", "blocks.1", "head.0", "head.1", "(rest)"]
    llama = build_model(preset("tiny"), "meta")  # containers are opened, blocks are not
    assert [n for n, _ in size_units(llama)] == ["embed", "layers.0", "layers.1", "layers.2", "layers.3",
                                                 "lm_head", "(rest)"]


# -- save / load --------------------------------------------------------------------------------------


def _train_and_save(env, kinds: list[str], kw: dict, ckpt: str, first: int, last: int, load: bool) -> dict:
    out = {}
    for kind in kinds:
        par = paratrain.Parallel(**kw)
        model, opt, sched = build(kind)
        model, opt = par.prepare(model, opt)
        par.register_for_checkpointing(sched)
        if load:
            par.load(f"{ckpt}/{kind}")
        losses = train_steps(par, model, opt, sched, first, last)
        if not load:
            par.save(f"{ckpt}/{kind}")
        out[kind] = (losses, par.full_state_dict(model))
    return out


def test_save_under_zero3_dp2_resumes_in_one_process(tmp_path):
    """Half the steps under ZeRO-3 dp2, save; the rest in one plain process (ZeRO-1) after load:
    the same losses and weights as one uninterrupted process (moments, momentum, scheduler kept)."""
    ckpt, kinds = str(tmp_path / "ckpt"), ["adamw", "sgd"]
    first = run(_train_and_save, 2, kinds, {"zero": 3}, ckpt, 0, STEPS // 2, False)[0]
    rest = run(_train_and_save, 1, kinds, {"zero": 1}, ckpt, STEPS // 2, STEPS, True)[0]
    for kind in kinds:
        assert_same((first[kind][0] + rest[kind][0], rest[kind][1]), reference(kind))


def _resume_same_layout(env, ckpt: str) -> tuple:
    straight = _train_with(env, ["adagrad"], {"zero": 0})["adagrad"]
    _train_and_save(env, ["adagrad"], {"zero": 0}, ckpt, 0, STEPS // 2, False)
    resumed = _train_and_save(env, ["adagrad"], {"zero": 0}, ckpt, STEPS // 2, STEPS, True)["adagrad"]
    return straight, resumed


def test_save_load_same_layout_continues_identically(tmp_path):
    """DDP dp2 saves, DDP dp2 loads: no reordering anywhere, so the continuation is bit-identical."""
    straight, resumed = run(_resume_same_layout, 2, str(tmp_path / "ckpt"))[0]
    assert resumed[0] == straight[0][STEPS // 2:]
    for name, w in straight[1].items():
        assert torch.equal(resumed[1][name], w), name


# -- tensor parallelism by a user plan ----------------------------------------------------------------

TP_PLAN = {"blocks.0.up": "colwise", "blocks.0.down": "rowwise", "blocks.1.up": "colwise",
           "blocks.1.down": "rowwise", "head.1": "colwise_gather"}


def _train_tp(env, kind: str) -> tuple:
    with pytest.raises(ValueError, match="'blocks.9.up', which is not a submodule of Net"):
        paratrain.Parallel(tp=2, tp_plan={"blocks.9.up": "colwise"}).prepare(*build(kind)[:2])
    with pytest.raises(ValueError, match="no tensor-parallel plan for Net; pass tp_plan"):
        paratrain.Parallel(tp=2).prepare(*build(kind)[:2])
    par = paratrain.Parallel(tp=2, tp_plan=TP_PLAN)
    model, opt, sched = build(kind)
    model, opt = par.prepare(model, opt)
    assert model.blocks[0].up.weight.shape == (DIM, DIM)  # half of the 2*DIM output features
    return train_steps(par, model, opt, sched, 0, STEPS), par.full_state_dict(model)


def test_tp2_user_plan_equals_one_process():
    got = run(_train_tp, 2, "adamw")[0]
    assert_same(got, reference("adamw"))


def _llama(steps: int, par_kwargs: dict | None, tie: bool = False) -> tuple[list[float], dict]:
    """paratrain's own tiny Llama, built by the user, trained by a plain loop (par None: plain torch);
    with pp > 1 the loop calls ``pipeline_step`` (two micro-batches) instead of forward + backward."""
    from paratrain.models import build_model, init_weights, preset

    cfg = preset("tiny", tie_embeddings=tie)
    torch.manual_seed(0)
    model = build_model(cfg, "cpu")
    init_weights(model, 0, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    par = paratrain.Parallel(**par_kwargs) if par_kwargs is not None else None
    if par is not None:
        model, opt = par.prepare(model, opt)
    losses = []
    for k in range(steps):
        g = torch.Generator().manual_seed(k)
        ids = torch.randint(0, cfg.vocab_size, (4, 33), generator=g)
        if par is not None and par.executor is not None:
            loss = par.pipeline_step(ids[:, :-1], ids[:, 1:], micro_batches=2)
        else:
            loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            if par is not None:
                par.backward(loss)
            else:
                loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = par.full_state_dict(model) if par is not None else model.state_dict()
    return losses, {k: v.detach().clone() for k, v in state.items()}


def _train_llama_tp(env) -> dict:
    return {sp: _llama(STEPS, {"tp": 2, "sequence_parallel": sp}) for sp in (False, True)}


def test_tp2_and_sp_native_llama_plan_equals_one_process():
    """paratrain's Llama needs no plan: its declared TP (and SP) plan applies, with whole logits."""
    got = run(_train_llama_tp, 2)[0]
    ref = _llama(STEPS, None)
    for sp in (False, True):
        assert_same(got[sp], ref)


def _train_llama_pp(env) -> dict:
    return {(schedule, tie): _llama(STEPS, {"pp": 2, "pp_schedule": schedule}, tie=tie)
            for schedule, tie in (("1f1b", False), ("gpipe", True), ("zb-h1", False), ("zbv", True))}


def test_pp2_native_llama_through_the_library_equals_one_process():
    """A paratrain family's pipeline through the user's loop (pipeline_step), tied embeddings too;
    the zero-bubble schedules (zbv: the tied pair on one rank) by their name too."""
    got = run(_train_llama_pp, 2)[0]
    for (_schedule, tie), result in got.items():
        assert_same(result, _llama(STEPS, None, tie=tie))


# (zero, schedule, tied): ZeRO-3 gathering each stage's units, the tied pair across the two stages
# (held back and summed over pp before ZeRO reduces it); a zero-bubble schedule under ZeRO-3 and -2.
PP_ZERO = {"z3_1f1b_tied": (3, "1f1b", True), "z3_zbv": (3, "zbv", False), "z2_zb-h1": (2, "zb-h1", False)}
PP_ZERO_STEPS = 2  # the second step runs on the weights the first step's reduce-scatter made


def _train_llama_pp_zero(env) -> dict:
    return {case: _llama(PP_ZERO_STEPS, {"pp": 2, "zero": zero, "pp_schedule": schedule}, tie=tie)
            for case, (zero, schedule, tie) in PP_ZERO.items()}


def test_pp2_dp2_zero_through_the_library_equals_one_process():
    """pp 2 x dp 2 under ZeRO-3 (and ZeRO-2) in the user's loop. Was: rank 2 died of a segfault in the
    last stage's final norm: the library took ZeRO-3 units by size, whose leftover unit (the final
    norm) is gathered by the whole model's forward, which a pipeline stage never calls (it runs
    its family's parts): the norm read a released parameter. Now the family's units, as the trainer's."""
    got = run(_train_llama_pp_zero, 4, timeout=120)[0]
    for case, (_zero, _schedule, tie) in PP_ZERO.items():
        assert_same(got[case], _llama(PP_ZERO_STEPS, None, tie=tie))


# -- bad input ------------------------------------------------------------------------------------------


def test_bad_input_is_refused_with_what_to_change():
    model, _, _ = build("sgd")
    with pytest.raises(NotElementwiseError, match="LBFGS is not known to be element-wise.*allow_non_elem"):
        paratrain.Parallel(zero=2).prepare(model, torch.optim.LBFGS(model.parameters()))
    # The user's word is enough to shard it (here with a class ZeRO really can step exactly).
    paratrain.Parallel(zero=1, allow_non_elementwise=True).prepare(*build("sgd")[:2])
    with pytest.raises(ValueError, match="units / unit_min_params with pp = 2: a pipeline stage runs"):
        paratrain.Parallel(pp=2, zero=3, unit_min_params=1000)
    with pytest.raises(ValueError, match="needs zero = 1, 2 or 3"):
        paratrain.Parallel(offload="cpu")
    with pytest.raises(ValueError, match="offload_dir"):
        paratrain.Parallel(zero=3, offload="disk")
    with pytest.raises(ValueError, match="sequence_parallel .* needs tp > 1"):
        paratrain.Parallel(sequence_parallel=True)
    with pytest.raises(ValueError, match="dp_mode = 'plain' is the un-bucketed DDP; ZeRO does its own"):
        paratrain.Parallel(zero=1, dp_mode="plain")
    with pytest.raises(ValueError, match="dp_mode = 'bucketed' must be 'ddp'"):
        paratrain.Parallel(dp_mode="bucketed")
    with pytest.raises(ValueError, match=r"units=\['nope'\] name no submodule of Net"):
        paratrain.Parallel(zero=3, units=["nope"]).prepare(*build("sgd")[:2])
    model, opt, _ = build("sgd")
    model.act = nn.GELU()  # registered, never a unit: it has nothing to gather
    with pytest.raises(ValueError, match=r"units=\['act'\] hold no parameters"):
        paratrain.Parallel(zero=3, units=["blocks.0", "act"]).prepare(model, opt)
    model, opt, _ = build("sgd")
    model.extra = nn.Linear(2, 2)  # trainable, but the optimizer does not know it
    with pytest.raises(ValueError, match=r"\['extra.weight', 'extra.bias'\] require grad but are in no"):
        paratrain.Parallel(zero=1).prepare(model, opt)


# -- the runnable example, under torchrun and as one plain process ------------------------------------


def _example(tmp_path: Path, name: str, *launcher: str, args: tuple = ()) -> dict:
    from safetensors.torch import load_file

    out = tmp_path / f"{name}.safetensors"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [*launcher, str(ROOT / "examples" / "own_loop.py"), "--steps", "4", "--out", str(out), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return load_file(str(out))


@pytest.fixture(scope="module")
def own_loop_one_process(tmp_path_factory) -> dict:
    """The example as one plain process: the same reference for every layout, run once."""
    return _example(tmp_path_factory.mktemp("own_loop"), "one", sys.executable)


@pytest.mark.parametrize("zero_args", [("--zero", "0"), ("--zero", "1"), ("--zero", "2"),
                                       ("--zero", "3", "--offload", "cpu")],
                         ids=["ddp", "z1", "z2", "z3-cpu"])
def test_example_own_loop_torchrun_equals_one_process(tmp_path, zero_args, own_loop_one_process):
    """The README's script, unchanged, under torchrun with 2 workers = one plain process."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    ref = own_loop_one_process
    got = _example(tmp_path, "two", torchrun, "--standalone", "--nproc-per-node", "2",
                   args=(*zero_args, "--save", str(tmp_path / "ckpt")))
    assert got.keys() == ref.keys() and len(ref) == 8
    for name, w in ref.items():
        torch.testing.assert_close(got[name], w, **FP32_REORDERED, msg=lambda m, n=name: f"{n}: {m}")
    assert (tmp_path / "ckpt" / "checkpoints" / "latest").exists()


# ------------------------------------------------------------------------------------------------
# check_collectives: the library turns on the trainer's collective checker
# ------------------------------------------------------------------------------------------------

def _library_skipping(env, check: bool) -> None:
    os.environ["PARATRAIN_TEST_SKIP_COLLECTIVE"] = "all-gather of unit 2"  # rank 1 skips it (faults.py)
    par = paratrain.Parallel(zero=3, units=["0", "2"], timeout=10, check_collectives=check)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    model, optimizer = par.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x = torch.randn(4, 8)
    for _ in range(2):
        par.backward(model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("check", [False, True], ids=["off", "on"])
def test_check_collectives_names_the_diverging_rank(check):
    from paratrain.launch import WorkerError

    with pytest.raises(WorkerError) as info:
        run(_library_skipping, 2, check, timeout=120)
    msg = str(info.value)
    assert ("CollectiveMismatch" in msg) == check, msg[:3000]
