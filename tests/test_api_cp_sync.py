"""The library door's context parallelism with averaging and the parameter server:
``paratrain.Parallel(cp=2, sync="local-sgd" | "diloco" | "parameter-server")`` in the user's own loop.

One launch of 4 workers (dp 2 x cp 2) and 1 server runs the three in turn in the same processes:
first the parameter server (ps_mode "sync": every cp rank a worker, the server rank leaves once the
workers close), then local SGD and DiLoCo over the workers' own process group. Each is compared with
one process: plain torch on the whole rows (the parameter server), or two whole replicas stepping
their own rows and averaged by hand (averaging: H > 1 steps are not one model's by design).

The model is paratrain's tiny Llama in float64 (tests/test_context_parallel.py's setup). Averaging:
REL64, as the other library cp tests (reordering noise ~1e-15; a cp rank's gradient not summed
inside its replica, a replica averaged over the wrong ranks or a wrong divisor moves the weights by
> 1e-2 with SGD at lr 0.5). The parameter server keeps fp32 values and sums the pushes in fp32
(api_ps.py), so it is compared as tests/test_api_param_server.py compares it: FP32_REORDERED.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dist import run
from tests.harness import FP32_REORDERED, assert_same_weights
from tests.test_context_parallel import REL64, _final_weights, _float64_llama

ROWS, STEPS, EVERY = 4, 3, 2  # the global batch's rows; averaged after step 2, end_period after step 3
PS_LR, INNER_LR, OUTER = 1e-2, 0.5, {"outer_lr": 0.7, "outer_momentum": 0.9}


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, 256, (ROWS, 33), generator=torch.Generator().manual_seed(step))


def _adamw(params):
    return torch.optim.AdamW(params, lr=PS_LR, weight_decay=0.0)  # the servers' rule: no decay on norms


def _sgd(params):
    return torch.optim.SGD(params, lr=INNER_LR)  # a gradient off by any factor moves the weights


def _cp_loop(par_kwargs: dict, make_opt, steps: int) -> tuple[list[float], dict]:
    """The user's loop: this dp slice's rows, cp_split, F.cross_entropy, par.backward; this rank's
    losses (its positions' mean) and the final weights (averaging: after end_period)."""
    with _float64_llama(par_kwargs, make_opt) as (cfg, model, opt, par):
        assert cfg.vocab_size >= 256
        n, losses = ROWS // par.dp_size, []
        for step in range(steps):
            ids = _ids(step)[par.dp_rank * n:][:n]
            x, y, positions = par.cp_split(ids[:, :-1], ids[:, 1:])
            loss = F.cross_entropy(model(x, positions).flatten(0, 1), y.flatten())
            par.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        par.end_period()
        weights = _final_weights(par, model)
        par.close()
        return losses, weights


def _on_rank(env) -> dict:
    try:
        ps = {"sync": "parameter-server", "servers": 1, "ps_group": env.world_group, "timeout": 30.0}
        out = {"parameter-server": _cp_loop({"cp": 2, **ps}, _adamw, 2)}
    except SystemExit as e:  # the server: served the 4 workers, then left
        return {"server": e.code}
    for mode, outer in (("local-sgd", {}), ("diloco", OUTER)):
        out[mode] = _cp_loop({"cp": 2, "sync": mode, "sync_every": EVERY, **outer}, _sgd, STEPS)
    return out


def _whole_rows(steps: int) -> tuple[list[float], dict]:
    """One process: plain torch on the global batch's rows, AdamW."""
    with _float64_llama(None, _adamw) as (_, model, opt, _):
        losses = []
        for step in range(steps):
            ids = _ids(step)
            loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, _final_weights(None, model)


@torch.no_grad()
def _average(replicas: list, start: list[torch.Tensor], outer: torch.optim.Optimizer | None) -> None:
    """Local SGD: every replica takes the mean; DiLoCo: the outer step along start - mean, then start."""
    params = [list(m.parameters()) for m, _ in replicas]
    mean = [(a + b) / 2 for a, b in zip(*params)]
    if outer is not None:
        for s, m in zip(start, mean):
            s.grad = s - m
        outer.step()
        mean = [s.clone() for s in start]
    for own in params:
        for p, m in zip(own, mean):
            p.copy_(m)


def _replicas_by_hand(mode: str) -> tuple[list[list[float]], dict]:
    """One process: two whole replicas, each stepping SGD on its own rows (half the batch), averaged
    every EVERY steps and at the end; each replica's losses, and the final weights."""
    with _float64_llama(None, _sgd) as (_, m0, o0, _), _float64_llama(None, _sgd) as (_, m1, o1, _):
        replicas, losses = [(m0, o0), (m1, o1)], [[], []]
        start = [p.detach().clone() for p in m0.parameters()]
        outer = torch.optim.SGD(start, lr=OUTER["outer_lr"], momentum=OUTER["outer_momentum"],
                                nesterov=True) if mode == "diloco" else None
        for step in range(STEPS):
            for r, (model, opt) in enumerate(replicas):
                ids = _ids(step)[r * ROWS // 2:][:ROWS // 2]
                loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses[r].append(loss.item())
            if (step + 1) % EVERY == 0 or step + 1 == STEPS:
                _average(replicas, start, outer)
        return losses, _final_weights(None, m0)


def _cp_mean(outs: list[dict], mode: str, ranks: tuple[int, int]) -> list[float]:
    """A batch's loss: the mean of its two cp ranks' (each the mean of as many positions)."""
    a, b = (outs[r][mode][0] for r in ranks)
    return [(x + y) / 2 for x, y in zip(a, b)]


@pytest.fixture(scope="module")
def outs() -> list[dict]:
    out = run(_on_rank, 5, group_size=4, timeout=90.0)
    assert out[4] == {"server": 0}
    return out[:4]


def test_cp2_with_the_parameter_server_equals_one_process(outs):
    """Every cp rank pushes its positions' share; the synchronous server's sum is the global batch's
    gradient: the losses and weights of plain torch on the whole rows (fp32 on the server)."""
    losses, weights = _whole_rows(2)
    got = [sum(o["parameter-server"][0][s] for o in outs) / 4 for s in range(2)]  # 4 x 1 row, same counts
    torch.testing.assert_close(torch.tensor(got), torch.tensor(losses), **FP32_REORDERED)
    for o in outs:
        assert_same_weights(o["parameter-server"][1], {k: v.float() for k, v in weights.items()},
                            **FP32_REORDERED, lr_steps=PS_LR * 2)


@pytest.mark.parametrize("mode", ["local-sgd", "diloco"])
def test_cp2_with_averaging_equals_whole_replicas_by_hand(outs, mode):
    """dp 2 x cp 2: a replica is one cp pair (summed every step), averaged with the other every
    EVERY steps and by end_period: as two whole replicas in one process."""
    losses, weights = _replicas_by_hand(mode)
    for replica, ranks in enumerate(((0, 1), (2, 3))):  # dp index = batch * cp + cp index (mesh.py)
        got = _cp_mean(outs, mode, ranks)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(losses[replica]), rtol=REL64, atol=0)
    for o in outs:
        got = o[mode][1]
        assert got.keys() == weights.keys()
        for name, w in weights.items():
            rel = ((got[name] - w).norm() / w.norm()).item()
            assert rel < REL64, f"{mode} {name}: {rel:.2e}"


def _async_worker(env) -> dict:
    """One worker made of a cp pair (dp 1 x cp 2) and 1 server, ps_mode "async"."""
    try:
        ps = {"sync": "parameter-server", "ps_mode": "async", "servers": 1, "ps_group": env.world_group,
              "timeout": 30.0}
        return {"async": _cp_loop({"cp": 2, **ps}, _adamw, 2)}
    except SystemExit as e:
        return {"server": e.code}


def test_async_parameter_server_with_a_cp_pair_as_one_worker_equals_one_process():
    """ps_mode "async" with cp 2: the pair is ONE worker (it sums its shares over cp, its cp index 0
    alone pushes and hands the new values to its peer), so with one worker every update is the
    whole batch's: plain torch on the whole rows. Were each cp rank its own async worker, each
    update would be half the positions' gradient and the losses would part from step 2."""
    out = run(_async_worker, 3, group_size=2, timeout=60.0)
    assert out[2] == {"server": 0}
    losses, weights = _whole_rows(2)
    got = _cp_mean(out[:2], "async", (0, 1))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(losses), **FP32_REORDERED)
    for o in out[:2]:
        assert_same_weights(o["async"][1], {k: v.float() for k, v in weights.items()},
                            **FP32_REORDERED, lr_steps=PS_LR * 2)
