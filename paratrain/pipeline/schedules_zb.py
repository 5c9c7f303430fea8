"""Zero-bubble pipeline schedules: the backward split into B (input gradient) and W (weights).

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024): the input gradient is all the previous
stage waits for, so ``B`` computes only that and the weight-gradient products of the same
micro-batch run later, as ``W`` (pipeline/weight_grad.py keeps what they need), wherever a rank
would otherwise idle. Actions as in schedules.py; a B with a W in the list is input-only.

* ``ZBH1`` ("zb-h1"): 1F1B's warm-up and steady state, each B followed by its W, except that rank
  r postpones its first r W passes to the cool-down, where 1F1B idles. Activations live from F
  to W, so rank r holds at most (p - r - 1) + r + 1 = p micro-batches: 1F1B's peak (rank 0's).
  Bubble (p-1)(F + B - W) against 1F1B's (p-1)(F + B + W): a third when the three are equal.
* ``ZBV`` ("zbv"): two stages per rank in a V (rank r holds stages r and 2p - 1 - r: the
  embedding and the head both on rank 0), the order of torch's ``ScheduleZBVZeroBubble``
  (torch/distributed/pipelining/schedules.py, 2.13), the paper's section 6: warm-up forwards of
  both chunks, then F / B / W triples of each chunk in turn, W passes filling the cool-down.
* ``DualPipeV`` ("dualpipev"): the V-shaped cut of DeepSeek-V3's DualPipe, the order of torch's
  ``ScheduleDualPipeV``. Its overlapped "F of one chunk with B of the other" (meant to hide
  expert-parallel all-to-alls behind computation) runs here as that F, then that B: on a CPU a
  rank computes one thing at a time. Its B passes are full backwards (no W) except those torch
  splits (the first half of the last ones), whose W passes fill the tail.

A W that a rank would run right after its own B, where that B's input gradient stays on the rank
(the first stage has none to send; at the turn of a V the previous stage is the rank's own), runs
inside that B instead, as one full backward (``fold_local_weights``): no other rank waits for
that gradient, so deferring the weights moves nothing, and the split costs (the forward's capture
and holding every linear's (input, output gradient) until W: about 6 % more per micro-batch on a
CPU, docs/pipeline_parallel.md). The order of computation on the rank is unchanged.

Schedules with a V placement need m >= 1 only: torch's ZBV plans at least 2p - 1 micro-batches
and leaves the missing ones' slots empty; the same is done here (``_keep``), and DualPipeV
requires m >= 2p as torch does.
"""

from __future__ import annotations

from paratrain.pipeline.schedules import SCHEDULES, Action, B, F, Schedule, ScheduleError, W, stage_rank


def fold_local_weights(order: list[Action], rank: int, schedule: Schedule) -> list[Action]:
    """``order`` with each B directly followed by its own W made one full B, where the B's input
    gradient does not leave ``rank``. A stage's last B folds only when no W at all follows it on
    the rank (the executor lets data-parallel sync through at the last gradient of each stage, and
    stages sharing a tied parameter count as one)."""
    last_b = {a.stage: i for i, a in enumerate(order) if a.kind == B}
    last_w = max((i for i, a in enumerate(order) if a.kind == W), default=-1)
    out: list[Action] = []
    i = 0
    while i < len(order):
        a = order[i]
        out.append(a)
        folds = (a.kind == B and i + 1 < len(order) and order[i + 1] == Action(W, a.mb, a.stage)
                 and (a.stage == 0 or stage_rank(a.stage - 1, schedule.p, schedule.placement) == rank)
                 and (i < last_b[a.stage] or last_w == i + 1))
        i += 2 if folds else 1
    return out


class ZBH1(Schedule):
    """ZB-H1: 1F1B with W passes; rank r delays its first r of them into the cool-down."""

    name = "zb-h1"

    def compute_order(self, rank: int) -> list[Action]:
        p, m = self.p, self.m
        warmup, delay = min(p - rank - 1, m), min(rank, m)
        out = [Action(F, mb, rank) for mb in range(warmup)]
        backwards = []
        for i in range(m - warmup):
            backwards.append([Action(F, warmup + i, rank), Action(B, i, rank)])
        backwards += [[Action(B, mb, rank)] for mb in range(m - warmup, m)]
        weights = iter(Action(W, mb, rank) for mb in range(m))
        for k, step in enumerate(backwards):
            out += step + ([next(weights)] if k >= delay else [])
        return fold_local_weights(out + list(weights), rank, self)

    def theory_bubble(self, t_f: float = 1.0, t_b: float = 2.0, t_w: float = 1.0) -> float:
        """(p-1)(F + B_input - W) idle per rank over m (F + B) of work; B_input = t_b - t_w."""
        idle = (self.p - 1) * max(0.0, t_f + (t_b - t_w) - t_w)
        return idle / (self.m * (t_f + t_b) + idle)


class _VSchedule(Schedule):
    """Two stages per rank in a V: rank r holds stages r (chunk 0) and 2p - 1 - r (chunk 1)."""

    placement = "v"
    multi_chunk = True

    def __init__(self, p: int, m: int, v: int = 2):
        if v not in (1, 2):
            raise ScheduleError(f"{self.name} runs exactly 2 stages per rank (a V): virtual stages "
                                f"{v} is not possible; leave --virtual-stages at 1 or 2")
        super().__init__(p, m, 2)

    @classmethod
    def chunks_per_rank(cls, v: int) -> int:
        return 2

    def theory_bubble(self) -> float:
        """The idle fraction of the ideal-time run with F = 1, B = 1, W = 1 per rank's share."""
        return self.ideal_bubble(t_f=1.0, t_b=2.0, t_w=1.0)

    def _stages(self, rank: int) -> tuple[int, int]:
        return rank, 2 * self.p - 1 - rank

    def _keep(self, actions: list[Action]) -> list[Action]:
        """Drop the slots of micro-batches beyond m (planned for the pipeline's fill)."""
        return [a for a in actions if a.mb < self.m]


class _Counters:
    """Next micro-batch per (stage, kind), and the queue of W passes still owed (oldest first)."""

    def __init__(self):
        self.next: dict[tuple[int, str], int] = {}
        self.owed: list[tuple[int, int]] = []
        self.out: list[Action] = []

    def add(self, stage: int, kind: str, split: bool = True) -> None:
        """F, or a B (``split``: input-only, its W owed for later; else a full backward)."""
        mb = self.next.get((stage, kind), 0)
        self.next[(stage, kind)] = mb + 1
        self.out.append(Action(kind, mb, stage))
        if kind == B and split:
            self.owed.append((mb, stage))

    def weight(self) -> None:
        """Run the oldest W owed, if any."""
        if self.owed:
            mb, stage = self.owed.pop(0)
            self.out.append(Action(W, mb, stage))


class ZBV(_VSchedule):
    """torch's ScheduleZBVZeroBubble order (its I is our input-only B)."""

    name = "zbv"

    def compute_order(self, rank: int) -> list[Action]:
        p = self.p
        n = max(2 * p - 1, self.m)  # torch plans the pipeline's fill even when m is smaller
        s0, s1 = self._stages(rank)
        nxt = {(s, k): 0 for s in (s0, s1) for k in (F, B, W)}
        out: list[Action] = []

        def emit(stage: int, *kinds: str) -> None:
            for kind in kinds:
                out.append(Action(kind, nxt[(stage, kind)], stage))
                nxt[(stage, kind)] += 1

        emit_many = [(2 * (p - rank) - 1, [(s0, F)]), (rank, [(s1, F), (s0, F)]),
                     (p - rank, [(s1, F), (s1, B), (s1, W)])]
        for count, steps in emit_many:
            for _ in range(count):
                for stage, kind in steps:
                    emit(stage, kind)
        while nxt[(s1, F)] < nxt[(s0, F)] or nxt[(s0, F)] < n:
            if nxt[(s0, F)] < n:
                emit(s0, F)
            emit(s0, B, W)
            emit(s1, F, B, W)
        for _ in range(rank):
            emit(s0, B)
            emit(s1, B)
        for _ in range(p - rank):
            emit(s0, B, W)
        for stage in (s1, s0):
            while nxt[(stage, W)] < nxt[(stage, B)]:
                emit(stage, W)
        return fold_local_weights(self._keep(out), rank, self)


class DualPipeV(_VSchedule):
    """torch's ScheduleDualPipeV order; its overlapped F&B pairs run as F then B."""

    name = "dualpipev"

    def __init__(self, p: int, m: int, v: int = 2):
        super().__init__(p, m, v)
        if m < 2 * p:
            raise ScheduleError(f"dualpipev needs at least as many micro-batches as stages: "
                                f"m = {m} < 2 * pp = {2 * p}; raise --global-batch or lower --micro-batch")

    def compute_order(self, rank: int) -> list[Action]:
        p, m = self.p, self.m
        s0, s1 = self._stages(rank)
        c = _Counters()
        for _ in range((p - rank - 1) * 2):
            c.add(s0, F)
        for _ in range(rank + 1):
            c.add(s0, F)
            c.add(s1, F)
        for _ in range(p - rank - 1):
            c.add(s1, B)
            c.weight()
            c.add(s1, F)
        for _ in range(m - 2 * p + rank + 1):
            c.add(s0, F)  # torch: overlapped F0 & B1 (or, first on the last rank, not overlapped)
            c.add(s1, B, split=False)
            c.add(s1, F)  # overlapped F1 & B0
            c.add(s0, B, split=False)
        for _ in range(p - rank - 1):
            c.add(s1, B, split=False)
            c.add(s1, F)
            c.add(s0, B, split=False)
        split = False
        for i in range(rank + 1):
            split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
            c.add(s1, B, split=split)
            split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
            c.add(s0, B, split=split)
        for _ in range(p - rank - 1):
            c.weight()
            c.add(s0, B, split=split)
        for _ in range(rank + 1):
            c.weight()
        return fold_local_weights(c.out, rank, self)


SCHEDULES.update({s.name: s for s in (ZBH1, ZBV, DualPipeV)})
