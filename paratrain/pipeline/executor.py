"""The pipeline executor: runs any schedule's action list on this rank.

Same interface as ``MicroBatchLoop`` (``run`` / ``evaluate``), so the trainer does not know it is
pipelined. What it does per action (schedules.py has the semantics):

* runs of consecutive SEND / RECV actions go out as one ``batch_isend_irecv``; a receive's
  buffer shape is known up front ([micro_batch, seq, dim]; seq / tp under sequence parallelism),
  so no shape exchange is needed;
* every rank builds the step's micro-batches from the same rows (``MicroBatch(x, y, positions)``),
  so each stage has its micro-batch's positions locally: packed rows' attention masks need no
  message between stages;
* F waits for its input activation (if it was received), runs its chunk, keeps (input, output)
  for the backward; on the last stage it computes the loss (sum over tokens / divisor). Losses
  the chunk's layers produced (``side_loss``: mixture-of-experts aux losses) are this stage's:
  added to the loss on the last stage, and on the others back-propagated together with the
  received output gradient, so they reach the stage's own parameters; the reported loss is the
  sum over stages;
* B waits for the output gradient, back-propagates it through the chunk and leaves the input
  gradient for SEND_B. Data-parallel gradient sync is held back (``strategy.no_sync()``) except
  for the last backward of each chunk, which lets DDP overlap it with the remaining backwards;
* zero-bubble schedules (schedules_zb.py): a B whose (mb, stage) has a W computes only the input
  gradient: its forward ran under ``WeightGradStore.capture()`` and its backward under
  ``deferring``, which keeps each linear's (input, output gradient); W computes the weight
  gradients from them (weight_grad.py). Sync is then let through on the chunk's last B (norms,
  biases, embeddings are final there) and on its last W (the linears' weights), so DDP's buckets
  launch during that W, and a chunk that finishes early reduces while the other chunk's W run;
* two consecutive stages on one rank (the turn of a V placement) hand the activation and its
  gradient over locally: no message.

Every computation's start and end are recorded (CUDA events on GPU, the clock on CPU): the
measured bubble and the timeline picture come from the real run.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from pathlib import Path

import torch
import torch.nn as nn

from paratrain.base.executor import (
    LossFn,
    MicroBatch,
    SavedTensors,
    SideLossFn,
    autocast_for,
    micro_batch,
    with_side_loss,
)
from paratrain.base.strategy import Strategy
from paratrain.base.weight_grad import WeightGradStore
from paratrain.comm import collectives as C
from paratrain.mesh import ParallelMesh
from paratrain.pipeline.schedules import (
    RECV_B,
    RECV_F,
    SCHEDULES,
    SEND_F,
    Action,
    B,
    F,
    Schedule,
    ScheduleError,
    W,
    is_local,
    make_schedule,
    message,
    receive_lookahead_for,
    split_backwards,
    stage_rank,
)
from paratrain.pipeline.stage import StageChunk, TiedEmbedding, ends_share_rank


class PipelineExecutor:
    def __init__(self, model: nn.Module, chunks: list[StageChunk], loss_fn: LossFn, strategy: Strategy,
                 mesh: ParallelMesh, *, schedule: str, virtual_stages: int, precision: str,
                 sequence_parallel: bool = False, side_loss: SideLossFn | None = None,
                 offload: SavedTensors | None = None):
        self.model, self.chunks = model, {c.stage: c for c in chunks}
        # --offload-activations: what each F saves for its B goes to host memory until the B runs
        # (the schedule keeps several micro-batches in flight, so this is where the bytes are).
        self.offload = offload
        self.saved_tensors = offload or contextlib.nullcontext
        self.side_loss = side_loss
        self.loss_fn, self.strategy, self.mesh = loss_fn, strategy, mesh
        self.p = mesh.pp.size
        kind = SCHEDULES[schedule] if schedule in SCHEDULES else make_schedule(schedule, 1, 1)
        self.schedule_name, self.v = schedule, kind.chunks_per_rank(virtual_stages)
        self.placement = kind.placement
        self.n_stages = self.p * self.v
        self.autocast = autocast_for(precision, mesh.device)
        same_rank = ends_share_rank(self.p, self.n_stages, self.placement)  # a V: both ends on rank 0
        self.tied = TiedEmbedding(model, mesh, same_rank=same_rank)
        # The tied pair's gradients are summed across the two end stages where the gradient is
        # whole: after DDP's all-reduce (launched from backward hooks, it must not race) or before
        # a reduction that shards it (ZeRO-1 after backward; ZeRO-2/3 hold the pair's bucket or
        # unit back from their hooks: after it, each stage's dp shard covers other elements of the
        # weight, so only the partner's reduced slice would be summed).
        self._tied_sum_first = not strategy.reduces_during_backward or (
            bool(self.tied.params) and strategy.hold_reduction(self.tied.params))
        self.weight_grads = WeightGradStore()  # zero-bubble schedules: the W passes' products
        # Activations between stages are the residual stream: the parameters' widest dtype even
        # under autocast (fp32 residual + bf16 branch promotes to fp32; a LoRA base stored in bf16
        # beside fp32 norms and adapters streams fp32, as one process does after the first norm).
        self.act_dtype = functools.reduce(torch.promote_types,
                                          {p.dtype for p in model.parameters() if p.is_floating_point()})
        self.dim = model.cfg.dim
        # Under sequence parallelism the residual stream between blocks, and so between stages,
        # holds this tp rank's 1/tp slice of the sequence.
        self.seq_shards = mesh.tp.size if sequence_parallel else 1
        self._schedules: dict[int, Schedule] = {}
        self._actions: dict[tuple[int, bool], list[Action]] = {}  # (m, train) -> this rank's list
        self.receive_lookahead = receive_lookahead_for(mesh.device.type)
        self.timeline: list[dict] = []  # last training step: one dict per computation
        self._trained_m: int | None = None  # micro-batches of the last training step

    def schedule(self, m: int) -> Schedule:
        if m not in self._schedules:
            self._schedules[m] = make_schedule(self.schedule_name, self.p, m, self.v)
        return self._schedules[m]

    def _rank_actions(self, m: int, train: bool) -> list[Action]:
        """This rank's action list, placed once per micro-batch count (a simulation per step
        would be work in the step's critical path)."""
        if (m, train) not in self._actions:
            sched = self.schedule(m)
            place = sched.actions if train else sched.forward_actions
            lists = place(self.receive_lookahead)
            self._actions[(m, train)] = lists[self.mesh.pp.rank]
        return self._actions[(m, train)]

    # -- the two entry points ------------------------------------------------------------------------

    def run(self, micro_batches: list[MicroBatch], divisor: float,
            loss_scale: float = 1.0) -> torch.Tensor:
        """One step's forwards and backwards; returns the step's loss share, the same on every stage."""
        self._trained_m = len(micro_batches)
        if self.offload is not None:
            self.offload.reset()
        actions = self._rank_actions(self._trained_m, train=True)
        total = self._execute(actions, micro_batches, divisor, loss_scale, train=True)
        if self._tied_sum_first:  # (__init__ says why the order)
            self.tied.all_reduce_grads()
            self.strategy.after_backward()
        else:
            self.strategy.after_backward()
            self.tied.all_reduce_grads()
        return self._loss_from_last_stage(total)

    def rehearse(self, micro_batches: list[MicroBatch], divisor: float) -> None:
        """One step's forwards and backwards and nothing after them (no gradient reduction, no
        tied-pair sum): ``--micro-batch auto``'s trial of a micro-batch size, whose memory peak is
        the schedule's, with several micro-batches in flight on a stage. Every stage runs it."""
        self._execute(self._rank_actions(len(micro_batches), train=True), micro_batches, divisor, 1.0,
                      train=True)

    def accepts(self, m: int) -> bool:
        """Whether the schedule runs ``m`` micro-batches per step (interleaved needs a multiple of p)."""
        try:
            self.schedule(m)
        except ValueError:
            return False
        return True

    @torch.no_grad()
    def evaluate(self, micro_batches: list[MicroBatch], divisor: float) -> torch.Tensor:
        actions = self._rank_actions(len(micro_batches), train=False)
        total = self._execute(actions, micro_batches, divisor, 1.0, train=False)
        return self._loss_from_last_stage(total)

    # -- running an action list ---------------------------------------------------------------------

    def _execute(self, actions: list[Action], micro_batches, divisor: float, loss_scale: float,
                 train: bool) -> torch.Tensor:
        dev = self.mesh.device
        total = torch.zeros((), dtype=torch.float32, device=dev)
        split = split_backwards([actions])
        ends = (0, self.n_stages - 1) if self.tied.one_parameter else ()
        syncs = _sync_points(actions, split, ends)
        saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (mb, stage) -> (in, out)
        sides: dict[tuple[int, int], torch.Tensor] = {}  # (mb, stage) -> side loss / divisor (not last)
        received: dict[tuple, tuple] = {}  # payload -> (work, buffer)
        sends: list[tuple] = []  # (work, tensor): the tensor must live until the send completes
        clock = _Clock(dev) if train else None
        i = 0
        while i < len(actions):
            if not actions[i].is_compute:
                j = i
                while j < len(actions) and not actions[j].is_compute:
                    j += 1
                self._post(actions[i:j], micro_batches, saved, received, sends)
                i = j
                continue
            a = actions[i]
            mb = micro_batch(micro_batches[a.mb])
            # The message this computation consumes: waiting for it is idle time, not work.
            needs = self._consumed(a, received, saved, train)
            if clock:
                clock.start(a)
            key = (a.mb, a.stage)
            deferred = key in split
            sync = contextlib.nullcontext() if i in syncs else self.strategy.no_sync()
            if a.kind == F:
                with self.weight_grads.capture() if deferred else contextlib.nullcontext():
                    total += self._forward(a, mb, needs, saved, sides, divisor, train)
            elif a.kind == W:
                with sync:
                    self.weight_grads.run(key)
            else:
                inp, out = saved[key]
                with sync, self.weight_grads.deferring(key) if deferred else contextlib.nullcontext():
                    if needs is None:  # the last stage starts backward from its loss
                        (out * loss_scale).backward() if loss_scale != 1.0 else out.backward()
                    elif key in sides:  # this stage's own losses join the backward
                        side = sides.pop(key)
                        torch.autograd.backward([out, side], [needs, torch.full_like(side, loss_scale)])
                    else:
                        torch.autograd.backward(out, needs)
                saved[key] = (inp, None)  # free the graph; keep the input for its gradient
            if clock:
                clock.end()
            i += 1
        for work, _ in sends:
            work.wait()
        if clock:
            self.timeline = clock.events()
        return total

    def _consumed(self, a: Action, received: dict, saved: dict, train: bool) -> torch.Tensor | None:
        """The tensor computation ``a`` consumes: its input activation (F) or its output's gradient
        (B), received (waiting for it is idle time, not work) or handed over by a stage on this rank."""
        if a.kind == F and a.stage > 0:
            if is_local(a, self.n_stages, self.p, self.placement):
                return saved[(a.mb, a.stage - 1)][1].detach().requires_grad_(train)
            return _wait(received.pop(("act", a.mb, a.stage))).requires_grad_(train)
        if a.kind == B and a.stage < self.n_stages - 1:
            if is_local(a, self.n_stages, self.p, self.placement):
                return saved.pop((a.mb, a.stage + 1))[0].grad
            return _wait(received.pop(("grad", a.mb, a.stage)))
        return None

    def _forward(self, a: Action, mb: MicroBatch, needs, saved: dict, sides: dict, divisor: float,
                 train: bool) -> torch.Tensor:
        """F: run the chunk; keep (input, output) for B; return the loss it adds (detached)."""
        inp = mb.x if a.stage == 0 else needs
        chunk = self.chunks[a.stage]
        with self.saved_tensors():  # the loss's saved tensors are offloaded too, as in one process
            with self.autocast():
                out = chunk(inp, mb.positions)
            if a.stage == self.n_stages - 1:
                out = self.loss_fn(out, mb.y)
        added = torch.zeros((), dtype=torch.float32, device=self.mesh.device)
        if a.stage == self.n_stages - 1:
            out = with_side_loss(out, self.side_loss, chunk.modules(), train) / divisor
            added = out.detach().float()
        else:
            out = out.to(self.act_dtype)
            side = self.side_loss(chunk.modules(), train) if self.side_loss is not None else None
            if side is not None:
                sides[(a.mb, a.stage)] = side / divisor
                added = sides[(a.mb, a.stage)].detach().float()
        saved[(a.mb, a.stage)] = (inp, out)
        return added

    def _post(self, comm: list[Action], micro_batches, saved: dict, received: dict, sends: list) -> None:
        """Launch a run of sends and receives as one batch (they may pair with the same peer)."""
        sends[:] = [(w, t) for w, t in sends if not w.is_completed()]  # free delivered tensors
        ops, kept = [], []  # kept[i]: ("recv", payload, buffer) or ("send", None, tensor)
        for a in comm:
            payload, src_stage, dst_stage = message(a, self.n_stages)
            if a.kind in (RECV_F, RECV_B):
                rows, seq = micro_batches[a.mb][0].shape[:2]
                buf = torch.empty(rows, seq // self.seq_shards, self.dim, dtype=self.act_dtype,
                                  device=self.mesh.device)
                ops.append(C.p2p_op_recv(buf, self.mesh.pp, stage_rank(src_stage, self.p, self.placement)))
                kept.append(("recv", payload, buf))
                continue
            inp, out = saved[(a.mb, a.stage)]
            if a.kind == SEND_F:
                t = out.detach().contiguous()  # [mb, seq, dim]
            else:
                t = inp.grad.contiguous()  # [mb, seq, dim]: d loss / d (this stage's input)
                del saved[(a.mb, a.stage)]
            ops.append(C.p2p_op_send(t, self.mesh.pp, stage_rank(dst_stage, self.p, self.placement)))
            kept.append(("send", None, t))
        for work, (kind, payload, t) in zip(C.batch_p2p(ops), kept):
            if kind == "recv":
                received[payload] = (work, t)
            else:
                sends.append((work, t))

    def _loss_from_last_stage(self, total: torch.Tensor) -> torch.Tensor:
        """The loss lives on the last stage, plus each stage's side losses: every stage reports the
        sum (users should not hunt for it; without side losses the other stages add zeros)."""
        with self.mesh.counter.paused():
            C.all_reduce(total, self.mesh.pp)
        return total.cpu()

    # -- measurements ---------------------------------------------------------------------------------

    def step_metrics(self) -> dict[str, float]:
        """``bubble``: the measured idle fraction of the last step (every rank calls this), and the
        bytes activation offload moved to host memory on this rank."""
        out = {"mem_activations_offloaded_bytes": self.offload.offloaded_bytes} if self.offload else {}
        if not self.timeline:
            return out
        return {**out, "bubble": measured_bubble(self.gather_timelines())}

    def gather_timelines(self) -> list[list[dict]]:
        """The last training step's computations of every stage (a collective: every rank calls)."""
        with self.mesh.counter.paused():
            return C.all_gather_object(self.timeline, self.mesh.pp)

    def write_timeline(self, out: str | Path, is_main: bool) -> None:
        """OUT/timeline.json: the last step's computations on every stage (written by rank 0)."""
        ranks = self.gather_timelines()
        if not is_main:
            return
        sched = self.schedule(self._trained_m) if self._trained_m else None
        m = sched.m if sched else 0
        info = {
            "schedule": self.schedule_name, "p": self.p, "v": self.v, "m": m,
            "bubble_measured": measured_bubble(ranks),
            "bubble_theory": sched.theory_bubble() if sched else None,
            "ranks": ranks,
        }
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "timeline.json").write_text(json.dumps(info))


def _sync_points(actions: list[Action], split: set[tuple[int, int]], joined: tuple[int, ...] = ()
                 ) -> set[int]:
    """Indices of the computations that let data-parallel sync through: each stage's last B and,
    where W passes follow it, its last W. A parameter's hook must fire once in sync, after its
    last gradient: so when W passes follow a stage's last B, that B must be input-only (a full one
    would hand the linears' gradients over before the W add to them). Stages in ``joined`` share
    a parameter (a tied embedding and head on one rank) and count as one stage: only their very
    last gradient lets sync through (the others' buckets then launch in after_backward)."""
    def group(stage: int) -> int:
        return joined[0] if stage in joined else stage

    last_b = {group(a.stage): i for i, a in enumerate(actions) if a.kind == B}
    last_w = {group(a.stage): i for i, a in enumerate(actions) if a.kind == W}
    out = set()
    for g, i in last_b.items():
        if last_w.get(g, -1) < i:
            out.add(i)  # no W after the last B: that B is the last gradient of everything
        elif (actions[i].mb, actions[i].stage) not in split:
            raise ScheduleError(f"stage {actions[i].stage}: W passes follow its last backward, a full one, "
                                "which would reduce the linears' gradients before they are complete")
        elif not joined or g != joined[0]:
            out |= {i, last_w[g]}
        else:
            out.add(last_w[g])  # joined: the last W is the one sync point (the last B came before)
    return out


def measured_bubble(ranks: list[list[dict]]) -> float:
    """Idle fraction: 1 - mean busy time / the step's span (first start to last end, all ranks)."""
    starts = [e["start"] for r in ranks for e in r]
    ends = [e["end"] for r in ranks for e in r]
    if not starts:
        return 0.0
    span = max(ends) - min(starts)
    busy = sum(e["end"] - e["start"] for r in ranks for e in r) / len(ranks)
    return max(0.0, 1.0 - busy / span) if span > 0 else 0.0


def _wait(handle: tuple) -> torch.Tensor:
    work, buf = handle
    if work is not None:
        work.wait()
    return buf


class _Clock:
    """Start/end of each computation: CUDA events on GPU (no host sync until the step ends), the
    clock otherwise. Times are seconds on the wall clock so ranks (and hosts) line up.

    On a CPU each computation also records ``cpu``: the seconds the computing thread itself ran
    (``time.thread_time``; the whole pass's compute with one intra-op thread, as local workers
    run). The wall time of a pass minus its CPU time is time the thread was not running: another
    process, or a gloo thread, held the core. Comparing passes across schedules
    by their CPU time tells a pass that does more work from one that was preempted
    (docs/pipeline_parallel.md, "Pass costs across schedules")."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.wall0, self.perf0 = time.time(), time.perf_counter()
        self.origin = self._mark()
        self.items: list[tuple[Action, object, object]] = []
        self.cpu: list[float] = []  # per item: thread CPU seconds (CPU only)

    def _mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def start(self, a: Action) -> None:
        if not self.cuda:
            self.cpu.append(time.thread_time())
        self.items.append((a, self._mark(), None))

    def end(self) -> None:
        a, s, _ = self.items[-1]
        self.items[-1] = (a, s, self._mark())
        if not self.cuda:
            self.cpu[-1] = time.thread_time() - self.cpu[-1]

    def _seconds(self, mark) -> float:
        if self.cuda:
            return self.wall0 + self.origin.elapsed_time(mark) / 1e3
        return self.wall0 + (mark - self.perf0)

    def events(self) -> list[dict]:
        if self.cuda and self.items:
            self.items[-1][2].synchronize()
        out = [{"kind": a.kind, "mb": a.mb, "stage": a.stage,
                "start": self._seconds(s), "end": self._seconds(e)} for a, s, e in self.items]
        for event, cpu in zip(out, self.cpu):
            event["cpu"] = cpu
        return out
