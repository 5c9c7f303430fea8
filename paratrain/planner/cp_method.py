"""``cp_method = "auto"``: ring or all-to-all by the planner's cost, for the trainer and the library.

The runtime (context_parallel/) sees no planner (the layers: docs/architecture.md); the trainer's
configuration (plan_cli/cp_method.py) and the library's first ``cp_split`` (api.py) settle "auto"
here and hand the attention an explicit method.
"""

from __future__ import annotations

from dataclasses import replace

from paratrain.config import Config
from paratrain.models.shape import ModelShape
from paratrain.perf.hardware import Cluster, make_cluster, preset_named
from paratrain.planner import context
from paratrain.planner.machine import local_cluster
from paratrain.planner.memory import Layout, Training
from paratrain.planner.search import config_layout, evaluate, training_from_config


def cheaper_cp_method(c: ModelShape, tr: Training, lay: Layout, cluster: Cluster) -> tuple[str, str]:
    """The method (ring | alltoall) whose step the planner prices cheaper for layout `lay` of model
    `c` on `cluster`, and why in words. A layout that fits beats one that does not; a tie keeps the
    ring; all-to-all only when the query heads per tp rank divide by cp."""
    priced = {m: evaluate(c, tr, replace(lay, cp_method=m), cluster)
              for m in context.methods(c, lay.cp, lay.tp, {})}
    method = min(priced, key=lambda m: (not priced[m].fits, priced[m].time.total))
    if len(priced) == 1:
        return method, (f"all-to-all scatters the query heads: {c.n_heads // lay.tp} per tp rank do not "
                        f"divide by cp {lay.cp}")
    words = ", ".join(f"{m} {p.time.total:.3g} s (exposed exchanges {p.time.cp_comm:.3g} s"
                      f"{'' if p.fits else ', does not fit'})" for m, p in priced.items())
    return method, f"the planner's step time on {cluster.device.name}: {words}"


def cp_method_choice(cfg: Config, cluster: Cluster) -> tuple[str, str]:
    """``--cp-method auto`` of a training config: ``cheaper_cp_method`` for its model, sequence and
    layout on `cluster`."""
    c, tr = training_from_config(cfg)
    return cheaper_cp_method(c, tr, config_layout(cfg), cluster)


def device_cluster(world: int, cuda_name: str | None, calibration: dict | None = None) -> Cluster:
    """The cluster of ``world`` workers on this host: its CUDA device's preset (``cuda_name`` as
    torch names it), else this CPU (``calibration``: plan_cli's measurement; None: nominal figures,
    also for a GPU no preset names)."""
    preset = preset_named(cuda_name) if cuda_name else None
    if preset is not None:
        return make_cluster(gpus=world, gpus_per_node=world, gpu=preset)
    return local_cluster(world, None if cuda_name else calibration)


def batch_cp_method(c: ModelShape, *, rows: int, seq: int, replicas: int, tp: int, cp: int, zero: int,
                    precision: str, cuda_name: str | None) -> tuple[str, str]:
    """The library's ``cp_method = "auto"`` at its first batch (api.py ``cp_split``): rows x seq on
    each of ``replicas`` data slices of cp ranks, on this host's device (its preset, or nominal CPU
    figures: every rank computes the same answer, nothing measured)."""
    tr = Training(seq_len=seq, global_batch=rows * replicas, precision=precision)
    lay = Layout(dp=replicas * cp, tp=tp, zero=zero, micro_batch=rows, cp=cp)
    return cheaper_cp_method(c, tr, lay, device_cluster(replicas * cp * tp, cuda_name))


__all__ = ["batch_cp_method", "cheaper_cp_method", "cp_method_choice", "device_cluster"]
