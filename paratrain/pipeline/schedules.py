"""Pipeline schedules as data: for every rank, the ordered list of actions it runs in one step.

A model cut into ``S = p * v`` stages runs on ``p`` ranks; with ``v`` virtual stages per rank
(Megatron-LM's interleaving) rank ``r`` holds stages ``r, r + p, r + 2p, ...`` (its *chunks*).
One optimizer step pushes ``m`` micro-batches through every stage forward, then back.

Actions (``Action(kind, mb, stage)``; the chunk of a stage is ``stage // p``):

* ``F`` / ``B``: forward / backward of micro-batch ``mb`` through ``stage``;
* ``W``: the weight gradients of micro-batch ``mb`` at ``stage`` (zero-bubble schedules,
  schedules_zb.py): a ``B`` whose ``(mb, stage)`` has a ``W`` in the list computes only the input
  gradient and leaves the weight-gradient products for ``W`` (pipeline/weight_grad.py); a ``B``
  without one is the full backward;
* ``SEND_F`` / ``RECV_F``: the activation leaving ``stage`` (to ``stage + 1``) / entering it;
* ``SEND_B`` / ``RECV_B``: the input gradient leaving ``stage`` (to ``stage - 1``) / the output
  gradient entering it (from ``stage + 1``).

Semantics (what the executor does and what ``check_schedule`` simulates): sends and receives
are *posted* without blocking (``isend`` / ``irecv``); a computation waits only for the message it
consumes. Between any two ranks, messages are matched in order (as NCCL does: no tags), so the
k-th receive a rank posts from a peer must expect exactly the k-th send of that peer to it.

Schedules only say in which order each rank computes; ``place_communication`` adds the sends and
receives by simulating the pipeline in ideal time, so every receive is posted in its sender's
order; on a CPU it then moves each receive one computation earlier, so its transfer overlaps the
receiver's current computation instead of waiting for a handshake after it
(``receive_lookahead_for``; ``check_stream_order`` says why not on a GPU).

* ``Naive``: model parallelism with one micro-batch in flight: everyone waits for everyone.
* ``GPipe`` (Huang et al. 2019): all forwards, then all backwards; m activations held per stage.
* ``OneFOneB`` (PipeDream-flush, Narayanan et al. 2021): ``p - r - 1`` warm-up forwards, then
  one forward / one backward alternating; at most ``p`` micro-batches in flight per rank.
* ``Interleaved1F1B`` (Megatron-LM, Narayanan et al. 2021): 1F1B over ``v`` chunks per rank, in
  groups of ``p`` micro-batches; the bubble shrinks by ``v`` for ``v`` times more messages.
* the zero-bubble ones (``W`` actions; zbv and dualpipev with the "v" placement): schedules_zb.py,
  registered in ``SCHEDULES`` when the package is imported (pipeline/__init__.py).

Over 500 lines: the schedules and the simulators that check them share one vocabulary (Action).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

F, B, W = "F", "B", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, W)
KINDS = (F, B, W, SEND_F, RECV_F, SEND_B, RECV_B)
PLACEMENTS = ("loop", "v")


class ScheduleError(ValueError):
    """An action list that cannot run: a missing or repeated action, a wrong order, a deadlock."""


@dataclass(frozen=True)
class Action:
    kind: str
    mb: int
    stage: int

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    def __repr__(self) -> str:
        return f"{self.kind}{self.mb}@s{self.stage}"


def Forward(mb: int, stage: int) -> Action:  # noqa: N802 - reads like the paper's notation
    return Action(F, mb, stage)


def Backward(mb: int, stage: int) -> Action:  # noqa: N802
    return Action(B, mb, stage)


def stage_rank(stage: int, p: int, placement: str = "loop") -> int:
    """The rank that holds ``stage``. "loop": dealt round-robin, stage s on rank s mod p (its
    chunk is s // p). "v" (ZBV, DualPipeV): chunks alternate direction, down then back up, so with
    2 chunks rank r holds stages r and 2p - 1 - r: the first and the last stage share rank 0."""
    chunk, pos = divmod(stage, p)
    return pos if placement == "loop" or chunk % 2 == 0 else p - 1 - pos


def Weight(mb: int, stage: int) -> Action:  # noqa: N802
    return Action(W, mb, stage)


def message(a: Action, n_stages: int) -> tuple[tuple, int, int] | None:
    """(payload, source stage, destination stage) of a communication action, else None.

    The payload names what travels: ("act", mb, s) is the input of stage s, ("grad", mb, s) the
    gradient of stage s's output. A send and the receive it matches carry the same payload.
    """
    mb, s = a.mb, a.stage
    if a.kind == SEND_F:
        return ("act", mb, s + 1), s, s + 1
    if a.kind == RECV_F:
        return ("act", mb, s), s - 1, s
    if a.kind == SEND_B:
        return ("grad", mb, s - 1), s, s - 1
    if a.kind == RECV_B:
        return ("grad", mb, s), s + 1, s
    return None


# --------------------------------------------------------------------------------------------
# Schedules: the order of computation on each rank.
# --------------------------------------------------------------------------------------------


class Schedule:
    """Base: p ranks, m micro-batches, v chunks per rank. Subclasses give ``compute_order``."""

    name = "schedule"
    placement = "loop"  # stage_rank's placement of the stages on the ranks
    multi_chunk = False  # whether v > 1 is allowed

    def __init__(self, p: int, m: int, v: int = 1):
        if p < 1 or m < 1 or v < 1:
            raise ScheduleError(f"{self.name}: p, m and v must be >= 1 (got p={p}, m={m}, v={v})")
        if v > 1 and not self.multi_chunk:
            raise ScheduleError(f"{self.name} runs one stage per rank: virtual stages need 'interleaved'")
        self.p, self.m, self.v = p, m, v

    @classmethod
    def chunks_per_rank(cls, v: int) -> int:
        """Stages per rank this schedule runs with ``--virtual-stages v`` (the V schedules: 2)."""
        return v

    def stage_rank(self, stage: int) -> int:
        return stage_rank(stage, self.p, self.placement)

    @property
    def n_stages(self) -> int:
        return self.p * self.v

    def compute_order(self, rank: int) -> list[Action]:
        raise NotImplementedError

    def actions(self, receive_lookahead: int = 0) -> list[list[Action]]:
        """Every rank's full action list, communication included (``receive_lookahead``:
        ``place_communication``)."""
        return place_communication([self.compute_order(r) for r in range(self.p)], self.p, self.n_stages,
                                   receive_lookahead, self.placement)

    def forward_actions(self, receive_lookahead: int = 0) -> list[list[Action]]:
        """Forward-only lists (evaluation): the same forward order, no backward."""
        lists = [[a for a in self.compute_order(r) if a.kind == F] for r in range(self.p)]
        return place_communication(lists, self.p, self.n_stages, receive_lookahead, self.placement)

    def theory_bubble(self) -> float:
        """Idle fraction of each rank in ideal time: (p-1)/(m+p-1), the interleaved one divided by v."""
        p, m, v = self.p, self.m, self.v
        return ((p - 1) / v) / (m + (p - 1) / v)

    def ideal_bubble(self, t_f: float = 1.0, t_b: float = 2.0, t_w: float | None = None) -> float:
        """Idle fraction found by simulating the lists with free communication (per-stage times
        t_f, t_b (the full backward, of which t_w, default t_b / 2, is the weight gradients) for a
        whole rank's share of the model; a chunk costs 1/v of it)."""
        t_w = t_b / 2 if t_w is None else t_w
        done = simulate([self.compute_order(r) for r in range(self.p)], self.p, self.n_stages,
                        t_f / self.v, t_b / self.v, t_w / self.v, self.placement)
        makespan = max(end for _, _, _, end in done)
        busy = self.m * (t_f + t_b)
        return 1.0 - busy / makespan


    def bubble_at(self, stage_costs: dict[int, tuple[float, float, float]]) -> float:
        """Idle fraction of the lists in ideal time (free communication) at per-stage pass costs
        (t_f, t_b, t_w: ``simulate``), counted as ``measured_bubble`` counts a real step: 1 - the
        ranks' mean busy time / the span. At measured costs: what the schedule itself leaves idle,
        so a measured bubble above it is the runtime's (messages, waits, noise)."""
        done = simulate([self.compute_order(r) for r in range(self.p)], self.p, self.n_stages,
                        placement=self.placement, stage_costs=stage_costs)
        span = max(end for _, _, _, end in done)
        busy = sum(end - start for _, _, start, end in done) / self.p
        return 1.0 - busy / span if span > 0 else 0.0


class Naive(Schedule):
    """One micro-batch at a time through the whole pipeline, forward then backward."""

    name = "naive"

    def compute_order(self, rank: int) -> list[Action]:
        return [a for mb in range(self.m) for a in (Forward(mb, rank), Backward(mb, rank))]

    def theory_bubble(self) -> float:
        return (self.p - 1) / self.p  # each rank works on 1 of the p stages' turn


class GPipe(Schedule):
    """All forwards, then all backwards (every micro-batch's activations alive at the turn)."""

    name = "gpipe"

    def compute_order(self, rank: int) -> list[Action]:
        return [Forward(mb, rank) for mb in range(self.m)] + [Backward(mb, rank) for mb in range(self.m)]


class OneFOneB(Schedule):
    """PipeDream-flush: warm up with p - rank - 1 forwards, then alternate; drain the backwards."""

    name = "1f1b"

    def compute_order(self, rank: int) -> list[Action]:
        warmup = min(self.p - rank - 1, self.m)
        out = [Forward(mb, rank) for mb in range(warmup)]
        for i in range(self.m - warmup):
            out += [Forward(warmup + i, rank), Backward(i, rank)]
        out += [Backward(mb, rank) for mb in range(self.m - warmup, self.m)]
        return out


class Interleaved1F1B(Schedule):
    """Megatron-LM's interleaved 1F1B: v chunks per rank, micro-batches in groups of p.

    The k-th forward of a rank runs chunk (k // p) mod v on micro-batch
    (k // (p v)) * p + k mod p; backwards walk the chunks in reverse. Warm-up:
    2 (p - rank - 1) + (v - 1) p forwards (all of them when m == p), as in Megatron-LM.
    """

    name = "interleaved"
    multi_chunk = True

    def __init__(self, p: int, m: int, v: int = 2):
        super().__init__(p, m, v)
        if m % p:
            raise ScheduleError(f"interleaved 1F1B needs the number of micro-batches ({m}) to be a "
                                f"multiple of pp ({p})")

    def _unit(self, k: int, forward: bool, rank: int) -> Action:
        p, v = self.p, self.v
        chunk = (k // p) % v
        if not forward:
            chunk = v - 1 - chunk
        mb = (k // (p * v)) * p + k % p
        return Action(F if forward else B, mb, chunk * p + rank)

    def compute_order(self, rank: int) -> list[Action]:
        p, total = self.p, self.m * self.v
        warmup = total if self.m == p else min(total, 2 * (p - rank - 1) + (self.v - 1) * p)
        out = [self._unit(k, True, rank) for k in range(warmup)]
        for k in range(total - warmup):
            out += [self._unit(warmup + k, True, rank), self._unit(k, False, rank)]
        out += [self._unit(k, False, rank) for k in range(total - warmup, total)]
        return out


SCHEDULES: dict[str, type[Schedule]] = {s.name: s for s in (Naive, GPipe, OneFOneB, Interleaved1F1B)}


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name](p, m, v)


# --------------------------------------------------------------------------------------------
# Ideal-time simulation and placement of the communication.
# --------------------------------------------------------------------------------------------


def _deps(a: Action, n_stages: int) -> list[Action]:
    """Computations that must finish before ``a`` (anywhere in the pipeline)."""
    if a.kind == F:
        return [Forward(a.mb, a.stage - 1)] if a.stage > 0 else []
    if a.kind == W:
        return [Backward(a.mb, a.stage)]
    out = [Forward(a.mb, a.stage)]
    if a.stage < n_stages - 1:
        out.append(Backward(a.mb, a.stage + 1))
    return out


def split_backwards(compute_lists: list[list[Action]]) -> set[tuple[int, int]]:
    """(mb, stage) of every backward that has a W: those B compute only the input gradient."""
    return {(a.mb, a.stage) for lst in compute_lists for a in lst if a.kind == W}


def simulate(compute_lists: list[list[Action]], p: int, n_stages: int, t_f: float = 1.0,
             t_b: float = 2.0, t_w: float | None = None, placement: str = "loop",
             stage_costs: dict[int, tuple[float, float, float]] | None = None,
             ) -> list[tuple[int, Action, float, float]]:
    """Run the compute lists in ideal time (free communication); each rank in its own order.

    ``t_b`` is a full backward; a B split from its W takes ``t_b - t_w`` and the W ``t_w``
    (default t_b / 2). ``stage_costs``: (t_f, t_b, t_w) of each stage instead (measured passes,
    where stages differ: the last one also runs the head and the loss). Returns (rank, action,
    start, end) in order of start time. Raises ScheduleError on deadlock. (``placement`` is
    accepted for symmetry: dependencies are by stage.)
    """
    t_w = t_b / 2 if t_w is None else t_w
    split = split_backwards(compute_lists)

    def duration(a: Action) -> float:
        f, b, w = stage_costs[a.stage] if stage_costs is not None else (t_f, t_b, t_w)
        return {F: f, W: w}.get(a.kind, b - w if (a.mb, a.stage) in split else b)
    pos, free = [0] * p, [0.0] * p
    end: dict[Action, float] = {}
    done = []
    total = sum(len(lst) for lst in compute_lists)
    while len(done) < total:
        best = None
        for r in range(p):
            if pos[r] == len(compute_lists[r]):
                continue
            a = compute_lists[r][pos[r]]
            deps = _deps(a, n_stages)
            if any(d not in end for d in deps):
                continue
            start = max([free[r]] + [end[d] for d in deps])
            if best is None or start < best[0]:
                best = (start, r, a)
        if best is None:
            blocked = {r: compute_lists[r][pos[r]] for r in range(p) if pos[r] < len(compute_lists[r])}
            raise ScheduleError(f"deadlock: every rank waits ({blocked})")
        start, r, a = best
        end[a] = free[r] = start + duration(a)
        pos[r] += 1
        done.append((r, a, start, end[a]))
    return done


def place_communication(compute_lists: list[list[Action]], p: int, n_stages: int,
                        receive_lookahead: int = 0, placement: str = "loop") -> list[list[Action]]:
    """Insert SEND right after the computation that produces a message and the matching RECV
    on the receiver at the same moment of the ideal-time run: receives are posted in their
    sender's order (the in-order matching holds) and before the computation that needs them.
    With ``receive_lookahead`` > 0 each receive then moves that many computations earlier
    (``_post_receives_early``: for backends whose point-to-point operations are independent).
    Two consecutive stages on one rank (the turn of a V placement) exchange nothing: the
    executor hands the tensor over locally."""
    lists: list[list[Action]] = [[] for _ in range(p)]
    for r, a, _, _ in simulate(compute_lists, p, n_stages, placement=placement):
        lists[r].append(a)
        if a.kind == F and a.stage < n_stages - 1:
            send, recv = Action(SEND_F, a.mb, a.stage), Action(RECV_F, a.mb, a.stage + 1)
        elif a.kind == B and a.stage > 0:
            send, recv = Action(SEND_B, a.mb, a.stage), Action(RECV_B, a.mb, a.stage - 1)
        else:
            continue
        dst = stage_rank(recv.stage, p, placement)
        if dst == r:
            if placement == "loop":
                raise ScheduleError(f"stages {a.stage} and {recv.stage} are both on rank {r}: "
                                    "a pipeline needs consecutive stages on different ranks (p >= 2)")
            continue
        lists[r].append(send)
        lists[dst].append(recv)
    if receive_lookahead > 0:
        lists = [_post_receives_early(lst, p, n_stages, receive_lookahead, placement) for lst in lists]
    return lists


def is_local(a: Action, n_stages: int, p: int, placement: str) -> bool:
    """Whether the message ``a``'s computation consumes (F: its input, B: its output's gradient)
    comes from a stage on the same rank (a local hand-off, no message)."""
    if a.kind == F and a.stage > 0:
        return stage_rank(a.stage - 1, p, placement) == stage_rank(a.stage, p, placement)
    if a.kind == B and a.stage < n_stages - 1:
        return stage_rank(a.stage + 1, p, placement) == stage_rank(a.stage, p, placement)
    return False


def receive_lookahead_for(device_type: str) -> int:
    """Computations a receive is posted ahead of its ideal-time place, by device.

    On a CPU (gloo) the host computes synchronously: a receive posted at its ideal-time place is
    posted only when the receiver's previous computation has finished, and gloo moves a message
    only once its receive is posted, so the handshake lands on the critical path of every 1F1B
    cycle (measured: 3-7 ms per message on a 2-core host). One computation earlier, the transfer
    overlaps that computation; gloo's operations are independent, so an early receive delays
    nothing else. On a GPU the host runs ahead of the device, so ideal-time receives are already
    posted early in device time; and NCCL runs a rank's point-to-point groups in issue order on
    one stream, where a receive moved before a send can deadlock (``check_stream_order``)."""
    return 1 if device_type == "cpu" else 0


def _post_receives_early(actions: list[Action], p: int, n_stages: int, lookahead: int,
                         placement: str = "loop") -> list[Action]:
    """Move every receive ``lookahead`` computations earlier on its rank.

    Under non-blocking semantics (gloo) receives never block, so no deadlock can follow; a receive
    never passes an earlier one from the same rank (messages match in order), and each costs one
    buffer of one micro-batch's activation while it waits.
    """
    out = list(actions)
    for i in range(len(out)):
        a = out[i]
        if a.kind not in (RECV_F, RECV_B):
            continue
        source = stage_rank(message(a, n_stages)[1], p, placement)
        j, passed = i, 0
        while j > 0:
            prev = out[j - 1]
            from_source = stage_rank(message(prev, n_stages)[1], p, placement) == source if prev.kind in (
                RECV_F, RECV_B) else False
            if from_source:
                break
            if prev.is_compute:
                if passed == lookahead:
                    break
                passed += 1
            j -= 1
        out.insert(j, out.pop(i))
    return out


# --------------------------------------------------------------------------------------------
# The checker.
# --------------------------------------------------------------------------------------------


def check_schedule(actions_per_rank: list[list[Action]], p: int, m: int, v: int = 1,
                   forward_only: bool = False, placement: str = "loop") -> None:
    """Verify an action list; raise ScheduleError saying what is wrong.

    * every micro-batch is forwarded (and backwarded) exactly once through every stage, on the
      rank that owns the stage (``placement``: stage_rank); every message is sent once and
      received once (none between two stages on one rank); a W at most once, after its B;
    * on a rank, a send follows the computation that produces it, a backward its forward;
    * simulated with non-blocking posts, in-order matching per pair of ranks and computations
      that wait for their input, every rank reaches its end (no deadlock, no mismatched pair).
    """
    if len(actions_per_rank) != p:
        raise ScheduleError(f"expected action lists for {p} ranks, got {len(actions_per_rank)}")
    n_stages = p * v
    _check_counts(actions_per_rank, p, m, n_stages, forward_only, placement)
    _simulate_messages(actions_per_rank, p, n_stages, placement)


def _expected(p: int, m: int, n_stages: int, forward_only: bool, placement: str) -> list[set[Action]]:
    want: list[set[Action]] = [set() for _ in range(p)]
    for s in range(n_stages):
        r = stage_rank(s, p, placement)
        remote_prev = s > 0 and stage_rank(s - 1, p, placement) != r
        remote_next = s < n_stages - 1 and stage_rank(s + 1, p, placement) != r
        for mb in range(m):
            want[r].add(Forward(mb, s))
            if remote_next:
                want[r].add(Action(SEND_F, mb, s))
            if remote_prev:
                want[r].add(Action(RECV_F, mb, s))
            if forward_only:
                continue
            want[r].add(Backward(mb, s))
            if remote_prev:
                want[r].add(Action(SEND_B, mb, s))
            if remote_next:
                want[r].add(Action(RECV_B, mb, s))
    return want


def _check_counts(lists: list[list[Action]], p: int, m: int, n_stages: int, forward_only: bool,
                  placement: str) -> None:
    for r, (got, want) in enumerate(zip(lists, _expected(p, m, n_stages, forward_only, placement))):
        seen: set[Action] = set()
        for a in got:
            if a.kind not in KINDS:
                raise ScheduleError(f"rank {r}: unknown action kind {a.kind!r}")
            if a in seen:
                raise ScheduleError(f"rank {r}: {a} appears twice")
            if a.kind == W and (forward_only or Backward(a.mb, a.stage) not in want):
                raise ScheduleError(f"rank {r}: {a} has no backward of its own on this rank")
            seen.add(a)
        seen = {a for a in seen if a.kind != W}
        if seen - want:
            raise ScheduleError(f"rank {r}: unexpected actions {sorted(seen - want, key=repr)} "
                                f"(wrong rank for the stage, or a stage/micro-batch out of range)")
        if want - seen:
            raise ScheduleError(f"rank {r}: missing actions {sorted(want - seen, key=repr)}")


def _simulate_messages(lists: list[list[Action]], p: int, n_stages: int, placement: str) -> None:
    pos = [0] * p
    done: list[set[Action]] = [set() for _ in range(p)]
    sent: dict[tuple[int, int], list[tuple]] = defaultdict(list)  # (src, dst) -> payloads in order
    posted: dict[tuple[int, int], list[tuple]] = defaultdict(list)  # (src, dst) -> expected payloads
    posted_at: list[dict[tuple, tuple[int, int, int]]] = [{} for _ in range(p)]  # payload -> slot

    def arrived(r: int, payload: tuple) -> bool:
        slot = posted_at[r].get(payload)
        return slot is not None and len(sent[slot[:2]]) > slot[2]

    def step(r: int) -> bool:
        a = lists[r][pos[r]]
        msg = message(a, n_stages)
        if msg is not None:
            payload, src_stage, dst_stage = msg
            src, dst = stage_rank(src_stage, p, placement), stage_rank(dst_stage, p, placement)
            if a.kind in (SEND_F, SEND_B):
                producer = Forward(a.mb, a.stage) if a.kind == SEND_F else Backward(a.mb, a.stage)
                if producer not in done[r]:
                    raise ScheduleError(f"rank {r}: {a} comes before {producer}, which produces it")
                k = len(sent[(src, dst)])
                sent[(src, dst)].append(payload)
                if k < len(posted[(src, dst)]) and posted[(src, dst)][k] != payload:
                    raise ScheduleError(_mismatch(src, dst, k, payload, posted[(src, dst)][k]))
            else:
                k = len(posted[(src, dst)])
                posted[(src, dst)].append(payload)
                posted_at[r][payload] = (src, dst, k)
                if k < len(sent[(src, dst)]) and sent[(src, dst)][k] != payload:
                    raise ScheduleError(_mismatch(src, dst, k, sent[(src, dst)][k], payload))
        else:
            if a.kind == B and Forward(a.mb, a.stage) not in done[r]:
                raise ScheduleError(f"rank {r}: {a} comes before its forward")
            if a.kind == W and Backward(a.mb, a.stage) not in done[r]:
                raise ScheduleError(f"rank {r}: {a} comes before its backward")
            if is_local(a, n_stages, p, placement):
                producer = _deps(a, n_stages)[-1]
                if producer not in done[r]:
                    raise ScheduleError(f"rank {r}: {a} comes before {producer}, on the same rank, "
                                        "which produces its input")
                done[r].add(a)
                pos[r] += 1
                return True
            needs = None
            if a.kind == F and a.stage > 0:
                needs = ("act", a.mb, a.stage)
            elif a.kind == B and a.stage < n_stages - 1:
                needs = ("grad", a.mb, a.stage)
            if needs is not None and not arrived(r, needs):
                return False  # waits for the peer (or for a receive it never posted: deadlock)
        done[r].add(a)
        pos[r] += 1
        return True

    while any(pos[r] < len(lists[r]) for r in range(p)):
        progress = False
        for r in range(p):
            while pos[r] < len(lists[r]) and step(r):
                progress = True
        if not progress:
            blocked = ", ".join(f"rank {r} at {lists[r][pos[r]]}" for r in range(p) if pos[r] < len(lists[r]))
            raise ScheduleError(f"deadlock: {blocked} (each waits for a message that is never sent, "
                                "or whose receive was not posted first)")


def check_stream_order(actions_per_rank: list[list[Action]], p: int, n_stages: int,
                       placement: str = "loop") -> None:
    """Verify the lists also run where point-to-point is stream-ordered (NCCL); raise on deadlock.

    The executor posts each run of consecutive sends and receives as one group
    (``batch_isend_irecv``). Under NCCL a rank's groups run one after another on one stream, each
    once the computations issued before it are done, and a group finishes only when every one of
    its operations has met its counterpart in a running group of the peer. A computation waits for
    the group holding the receive it consumes. ``check_schedule`` assumes independent operations
    (gloo), which a list can satisfy and still deadlock here.
    """
    items = [_host_items(lst) for lst in actions_per_rank]
    group_of: dict[tuple, tuple[int, int]] = {}  # payload -> (rank, item) of its receive / send
    for r, rank_items in enumerate(items):
        for i, item in enumerate(rank_items):
            if isinstance(item, list):
                for a in item:
                    group_of[(a.kind in (RECV_F, RECV_B), message(a, n_stages)[0])] = (r, i)
    started: set[tuple[int, int]] = set()
    done: set[tuple[int, int]] = set()

    def ready(r: int, i: int) -> bool:
        item = items[r][i]
        before = [j for j in range(i) if (isinstance(items[r][j], list)) != isinstance(item, list)]
        if isinstance(item, list):  # waits for its stream's previous group and the host's computations
            prev = max((j for j in range(i) if isinstance(items[r][j], list)), default=None)
            return (prev is None or (r, prev) in done) and all((r, j) in done for j in before)
        prev = max((j for j in range(i) if not isinstance(items[r][j], list)), default=None)
        needs = None if is_local(item, n_stages, p, placement) else _consumes(item, n_stages)
        return ((prev is None or (r, prev) in done)
                and (needs is None or group_of[(True, needs)] in done))

    def matched(r: int, i: int) -> bool:
        return all(group_of[(a.kind not in (RECV_F, RECV_B), message(a, n_stages)[0])] in started
                   for a in items[r][i])

    progress = True
    while progress:
        progress = False
        for r in range(p):
            for i in range(len(items[r])):
                key = (r, i)
                if key in done:
                    continue
                if key not in started and ready(r, i):
                    started.add(key)
                    progress = True
                if key in started and (not isinstance(items[r][i], list) or matched(r, i)):
                    done.add(key)
                    progress = True
    stuck = [f"rank {r} at {items[r][i]}" for r in range(p) for i in range(len(items[r]))
             if (r, i) not in done and (i == 0 or (r, i - 1) in done)]
    if stuck:
        raise ScheduleError(f"deadlock under stream-ordered point-to-point (NCCL): {', '.join(stuck)}")


def _host_items(actions: list[Action]) -> list:
    """A rank's list as the executor issues it: computations, and runs of communication (groups)."""
    out: list = []
    for a in actions:
        if a.is_compute:
            out.append(a)
        elif out and isinstance(out[-1], list):
            out[-1].append(a)
        else:
            out.append([a])
    return out


def _consumes(a: Action, n_stages: int) -> tuple | None:
    """The payload a computation waits for: its input activation or its output's gradient."""
    if a.kind == F and a.stage > 0:
        return ("act", a.mb, a.stage)
    if a.kind == B and a.stage < n_stages - 1:
        return ("grad", a.mb, a.stage)
    return None


def _mismatch(src: int, dst: int, k: int, sent: tuple, expected: tuple) -> str:
    return (f"messages from rank {src} to rank {dst} are matched in order, but send #{k} carries "
            f"{sent} while receive #{k} expects {expected}")


def peak_receives_posted(actions: list[Action], n_stages: int) -> int:
    """Most receives posted on a rank and not yet consumed at once (its receive buffers)."""
    waiting: set[tuple] = set()
    peak = 0
    for a in actions:
        if a.kind in (RECV_F, RECV_B):
            waiting.add(message(a, n_stages)[0])
        elif a.kind == F:
            waiting.discard(("act", a.mb, a.stage))
        elif a.kind == B:
            waiting.discard(("grad", a.mb, a.stage))
        peak = max(peak, len(waiting))
    return peak


def peak_in_flight(actions: list[Action]) -> int:
    """Most (micro-batch, stage) forwards whose activations are alive at once on a rank: from F to
    its B, or to its W when it has one (W still holds the linears' inputs and output gradients)."""
    split = split_backwards([actions])
    live = peak = 0
    for a in actions:
        if a.kind == F:
            live += 1
            peak = max(peak, live)
        elif a.kind == W or (a.kind == B and (a.mb, a.stage) not in split):
            live -= 1
    return peak
