"""The library's parameter server: ``paratrain.Parallel(sync="parameter-server")`` (api_ps.py).

A user's loop (its own module, torch's AdamW with a no-decay group, an LR scheduler, clipping on
some steps and not others, a save and load before the last step) on 2 workers and 1 server equals
one process training on the global batch: the same AdamW steps, on the servers. fp32 throughout
(the servers keep fp32 values), and the two workers' gradients are summed on the server in another
order than one process's backward: FP32_REORDERED. The server rank leaves ``Parallel(...)`` with
SystemExit(0) once both workers have closed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import paratrain
from paratrain import api_ps
from tests.dist import run
from tests.harness import FP32_REORDERED

ROWS, STEPS, MAX_NORM = 8, 3, 0.05  # global batch; clipped on steps 0 and 2 (the norm is ~0.5)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _optimizer(model: nn.Module) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    biases = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-2, foreach=False)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 3, generator=g)


def _train(model: nn.Module, opt, scheduler, step_rows, backward, clip,
           steps: range = range(STEPS)) -> None:
    for step in steps:
        x, y = step_rows(*_batch(step))
        backward(nn.functional.mse_loss(model(x), y))
        if step != 1:
            clip(MAX_NORM)
        opt.step()
        opt.zero_grad()
        scheduler.step()


def _ps_rank(env, ckpt: str) -> tuple[str, object]:
    try:
        par = paratrain.Parallel(sync="parameter-server", servers=1, ps_group=env.world_group, timeout=30.0)
    except SystemExit as e:  # a server: served both workers, then left
        return "server", e.code
    model = _model()
    opt, scheduler = _optimizer(model)
    model, popt = par.prepare(model, opt)
    rows = ROWS // par.dp_size

    def mine(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[par.dp_rank * rows:(par.dp_rank + 1) * rows], y[par.dp_rank * rows:(par.dp_rank + 1) * rows]

    par.register_for_checkpointing(scheduler)
    _train(model, popt, scheduler, mine, par.backward, par.clip_grad_norm_, range(STEPS - 1))
    par.save(ckpt)  # the servers' values and moments, then back: the last step continues from them
    par.load(ckpt)
    _train(model, popt, scheduler, mine, par.backward, par.clip_grad_norm_, range(STEPS - 1, STEPS))
    state = par.full_state_dict(model)
    par.close()
    return "worker", state


def test_library_loop_equals_one_process(tmp_path):
    model = _model()
    opt, scheduler = _optimizer(model)
    _train(model, opt, scheduler, lambda x, y: (x, y), lambda loss: loss.backward(),
           lambda m: torch.nn.utils.clip_grad_norm_(model.parameters(), m))
    out = run(_ps_rank, 3, str(tmp_path), group_size=2, timeout=60.0)
    assert out[2] == ("server", 0)
    for kind, state in out[:2]:
        assert kind == "worker" and state.keys() == model.state_dict().keys()
        for name, want in model.state_dict().items():
            torch.testing.assert_close(state[name], want, **FP32_REORDERED, msg=name)
    assert not torch.equal(out[0][1]["0.weight"], _model().state_dict()["0.weight"]), "nothing trained"


@pytest.mark.parametrize("kwargs, fragment", [
    ({"sync": "parameter-server", "tp": 2}, "drop tp = 2"),
    ({"sync": "parameter-server", "zero": 1}, "drop zero = 1"),
    ({"servers": 2}, "servers = 2 applies to sync = 'parameter-server' only"),
    ({"sync": "parameter-server", "max_staleness": 1}, "bounds ps_mode = 'async'"),
    ({"sync": "parameter-server", "sync_every": 4}, "--sync-every"),
    ({"sync": "parameter-server"}, "start the script with torchrun"),  # one plain process: no server
])
def test_bad_keywords_are_refused_before_serving(kwargs, fragment):
    with pytest.raises(ValueError, match="paratrain.Parallel") as e:
        paratrain.Parallel(**kwargs)
    assert fragment in str(e.value)


def test_optimizer_the_servers_cannot_run_is_refused():
    model = _model()
    with pytest.raises(ValueError, match="build a torch.optim.AdamW"):
        api_ps.server_adamw(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="weight_decay = 0.0"):  # AdamW's default decays biases too
        api_ps.server_adamw(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    opt, _ = _optimizer(model)
    assert api_ps.server_adamw(model, opt).weight_decay == 0.1
