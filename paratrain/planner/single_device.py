"""One device: walk the seeds' decision tree and say which step makes the model fit.

    batch -> accumulation -> checkpointing -> 8-bit optimizer -> mixed precision -> offload -> tiling

Each step keeps what the steps before it turned on and adds one saver; at each step the
micro-batch is the largest divisor of the global batch that fits (gradient accumulation keeps the
global batch, so a smaller micro-batch changes speed, not training). The first step whose memory
fits is the answer; the steps after it are listed as headroom. Pure: figures from
planner/memory.py (model states per the ZeRO paper, activations per Korthikanti et al.) and the
savers' own formulas (paratrain/memory/tiling.py), no runtime code.

Offload is ZeRO-Infinity on one device (``--zero 3 --offload cpu``: parameters, gradients and
optimizer state in host memory, gathered block by block) plus ``--offload-activations cpu``
(saved activations in host memory; the device keeps about two blocks' worth while they stream).
Tiling (``--tile N``) computes the MLPs and the LM head + loss in N tiles of tokens: the logits'
working memory and the recomputed block's MLP intermediates fall N-fold.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from paratrain.models.shape import ModelShape
from paratrain.perf.hardware import GB, Cluster
from paratrain.perf.ops import ACT_BYTES
from paratrain.planner.memory import (
    Layout,
    Memory,
    Training,
    device_memory,
    layer_activation_bytes,
    vocab_local,
)

MAX_TILES = 64


@dataclass(frozen=True)
class Savers:
    """What is turned on at one step of the walk."""

    accumulate: bool = False
    recompute: str = "none"
    optimizer: str = "adamw"
    precision: str = "fp32"
    offload: bool = False
    tile: int = 1


@dataclass
class Step:
    name: str
    flags: str  # the paratrain train flags this step adds
    savers: Savers
    micro_batch: int
    memory: Memory
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.memory.fits


# The seeds' order: (step name, flags it adds, how it changes the savers before it).
STEPS: list[tuple[str, str, dict]] = [
    ("batch", "(the whole global batch in one micro-batch)", {}),
    ("accumulation", "--micro-batch M (gradient accumulation keeps the global batch)", {"accumulate": True}),
    ("checkpointing (selective)", "--recompute selective", {"recompute": "selective"}),
    ("checkpointing (full)", "--recompute full", {"recompute": "full"}),
    ("8-bit optimizer", "--optimizer adamw8bit", {"optimizer": "adamw8bit"}),
    ("mixed precision", "--precision bf16", {"precision": "bf16"}),
    ("offload", "--zero 3 --offload cpu --offload-activations cpu", {"offload": True}),
    ("tiling", "--tile N", {"tile": None}),  # None: the smallest N that fits
]


def step_memory(c: ModelShape, tr: Training, s: Savers, micro_batch: int, cluster: Cluster) -> Memory:
    """Device memory of one device training with savers `s` at `micro_batch`."""
    t = replace(tr, precision=s.precision, optimizer=s.optimizer)
    lay = Layout(micro_batch=micro_batch, recompute=s.recompute, zero=3 if s.offload else 0,
                 offload="cpu" if s.offload else "none")
    mem = device_memory(c, t, lay, cluster)
    tokens = tr.seq_len * micro_batch
    if s.tile > 1:
        logits = tokens * vocab_local(c, 1) * 4  # the fp32 logits' gradient in transient_bytes
        mem.transient -= logits * (1 - 1 / s.tile)
        mem.activations -= tokens * vocab_local(c, 1) * 4 * (1 - 1 / s.tile)  # the kept log-softmax
        if s.recompute == "full":  # the rebuilt block's MLP intermediates (4 x ffn per token)
            mem.transient -= 4 * tokens * c.ffn_dim * ACT_BYTES[s.precision] * (1 - 1 / s.tile)
        if s.recompute != "full":  # every block's MLP intermediates are no longer kept
            mem.activations -= c.n_layers * 4 * tokens * c.ffn_dim * ACT_BYTES[s.precision]
    if s.offload:  # activations stream to the host; about two blocks' worth stay on the device
        block = layer_activation_bytes(c, tr.seq_len, micro_batch, recompute=s.recompute,
                                       precision=s.precision, frozen_gains=tr.frozen_gains)
        moved = max(0.0, mem.activations - 2 * block)
        mem.activations -= moved
        mem.offloaded += moved
    return mem


def _largest_fitting(c, tr, s: Savers, cluster) -> tuple[int, Memory]:
    """The largest micro-batch (a divisor of the global batch) that fits; else 1 and its memory."""
    if not s.accumulate:
        return tr.global_batch, step_memory(c, tr, s, tr.global_batch, cluster)
    for mb in sorted((d for d in range(1, tr.global_batch + 1) if tr.global_batch % d == 0), reverse=True):
        mem = step_memory(c, tr, s, mb, cluster)
        if mem.fits:
            return mb, mem
    return 1, step_memory(c, tr, s, 1, cluster)


def walk(c: ModelShape, tr: Training, cluster: Cluster) -> list[Step]:
    """Every step of the walk, in the seeds' order (stop reading at the first that fits)."""
    steps, s = [], Savers()
    for name, flags, change in STEPS:
        if "tile" in change:
            tile, found = 2, None
            while tile <= MAX_TILES and found is None:
                mb, mem = _largest_fitting(c, tr, replace(s, tile=tile), cluster)
                if mem.fits:
                    found = tile
                else:
                    tile *= 2
            s = replace(s, tile=found or MAX_TILES)
            flags = f"--tile {s.tile}"
        else:
            s = replace(s, **change)
        mb, mem = _largest_fitting(c, tr, s, cluster)
        shown = flags.replace("--micro-batch M", f"--micro-batch {mb}")
        steps.append(Step(name, shown, s, mb, mem))
    return steps


def first_fit(steps: list[Step]) -> Step | None:
    return next((st for st in steps if st.fits), None)


def train_flags(step: Step) -> str:
    """The `paratrain train` flags of one step of the walk (everything it keeps turned on)."""
    s = step.savers
    out = [f"--micro-batch {step.micro_batch}", f"--precision {s.precision}"]
    if s.recompute != "none":
        out.append(f"--recompute {s.recompute}")
    if s.optimizer != "adamw":
        out.append(f"--optimizer {s.optimizer}")
    if s.offload:
        out.append("--zero 3 --offload cpu --offload-activations cpu")
    if s.tile > 1:
        out.append(f"--tile {s.tile}")
    return " ".join(out)


def walk_report(steps: list[Step]) -> str:
    lines = ["single device: the seeds' walk (each step keeps the ones before it)",
             f"  {'#':>2} {'step':<26} {'micro-batch':>11} {'states GB':>9} {'acts GB':>8} {'other GB':>8} "
             f"{'total GB':>8} {'usable GB':>9}  fits"]
    for i, st in enumerate(steps, 1):
        m = st.memory
        other = m.comm_buffers + m.transient + m.runtime
        lines.append(f"  {i:>2} {st.name:<26} {st.micro_batch:>11} {m.model_states / GB:9.2f} "
                     f"{m.activations / GB:8.2f} {other / GB:8.2f} {m.total / GB:8.2f} {m.usable / GB:9.2f}  "
                     f"{'yes' if st.fits else 'no'}")
    hit = first_fit(steps)
    if hit is None:
        lines.append("  no step makes it fit on one device: use more devices (ZeRO-3 over dp, tp, pp)")
    else:
        n = steps.index(hit) + 1
        lines.append(f"  step {n} ({hit.name}) makes it fit, with the flags {train_flags(hit)}")
    return "\n".join(lines)


def walk_json(steps: list[Step]) -> dict:
    hit = first_fit(steps)
    return {"fits_at_step": None if hit is None else hit.name,
            "train_flags": None if hit is None else train_flags(hit),
            "steps": [{"step": st.name, "flags": st.flags, "micro_batch": st.micro_batch, "fits": st.fits,
                       **{f"{k}_bytes": v for k, v in st.memory.breakdown().items()}} for st in steps]}
