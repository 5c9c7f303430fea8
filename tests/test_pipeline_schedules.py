"""Pipeline schedules as data (no processes): every list passes the checker, the checker catches
broken lists, in-flight micro-batches and ideal-time bubbles match the papers' formulas."""

import pytest

from paratrain.pipeline.schedules import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    Backward,
    Forward,
    GPipe,
    Interleaved1F1B,
    Naive,
    OneFOneB,
    ScheduleError,
    check_schedule,
    check_stream_order,
    make_schedule,
    peak_in_flight,
    receive_lookahead_for,
)

CLASSIC = ("naive", "gpipe", "1f1b", "interleaved")  # the zero-bubble ones: test_pipeline_zb.py
CASES = [(name, p, m, v)
         for name in CLASSIC
         for p in (1, 2, 3, 4)
         for m in (1, 2, 4, 8)
         for v in ((2, 3) if name == "interleaved" else (1,))
         if not (name == "interleaved" and (p < 2 or m % p))]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_every_schedule_passes_the_checker(name, p, m, v):
    s = make_schedule(name, p, m, v)
    for lookahead in (0, 1):  # GPU placement, CPU placement (receive_lookahead_for)
        check_schedule(s.actions(lookahead), p, m, v)
        check_schedule(s.forward_actions(lookahead), p, m, v, forward_only=True)


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_ideal_bubble_is_the_formula(name, p, m, v):
    """Simulated with F = 1, B = 2 per rank (a chunk costs 1/v): GPipe and 1F1B idle (p-1)/(m+p-1),
    interleaved ((p-1)/v)/(m+(p-1)/v) (Megatron-LM: bubble time divided by v), naive (p-1)/p."""
    s = make_schedule(name, p, m, v)
    expected = {"naive": (p - 1) / p}.get(name, ((p - 1) / v) / (m + (p - 1) / v))
    assert s.theory_bubble() == pytest.approx(expected)
    assert s.ideal_bubble() == pytest.approx(expected, abs=1e-12)
    assert s.ideal_bubble(t_f=1.0, t_b=1.0) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 2), (3, 5)])
def test_in_flight_micro_batches(p, m):
    """1F1B keeps at most p micro-batches alive on a rank (p - rank), GPipe all m, naive 1."""
    for r in range(p):
        assert peak_in_flight(OneFOneB(p, m).compute_order(r)) == min(p - r, m)
        assert peak_in_flight(GPipe(p, m).compute_order(r)) == m
        assert peak_in_flight(Naive(p, m).compute_order(r)) == 1


def test_interleaved_order_matches_megatron():
    """p=2, v=2, m=4 on rank 0: micro-batches in groups of p through chunk 0, then chunk 1."""
    order = Interleaved1F1B(2, 4, 2).compute_order(0)
    assert order[:4] == [Forward(0, 0), Forward(1, 0), Forward(0, 2), Forward(1, 2)]
    assert order[-1] == Backward(3, 0)  # the drain ends with chunk 0's last micro-batch
    # the first backward on rank 0 is of the last chunk (stage 2), micro-batch 0
    assert next(a for a in order if a.kind == "B") == Backward(0, 2)


def test_one_f_one_b_steady_state_alternates():
    order = OneFOneB(4, 8).compute_order(1)
    kinds = "".join(a.kind for a in order)
    assert kinds == "FF" + "FB" * 6 + "BB"


# -- the checker catches what is wrong --------------------------------------------------------


def _gpipe(p=2, m=2):
    return GPipe(p, m).actions()


def test_checker_rejects_a_missing_backward():
    lists = _gpipe()
    lists[1].remove(Backward(1, 1))
    with pytest.raises(ScheduleError, match="missing actions"):
        check_schedule(lists, 2, 2)


def test_checker_rejects_a_repeated_forward():
    lists = _gpipe()
    lists[0].insert(1, Forward(0, 0))
    with pytest.raises(ScheduleError, match="twice"):
        check_schedule(lists, 2, 2)


def test_checker_rejects_a_stage_on_the_wrong_rank():
    lists = _gpipe()
    lists[0].append(Forward(0, 1))
    with pytest.raises(ScheduleError, match="unexpected"):
        check_schedule(lists, 2, 2)


def test_checker_rejects_a_send_before_its_producer():
    lists = _gpipe()
    i, j = lists[0].index(Forward(0, 0)), lists[0].index(Action(SEND_F, 0, 0))
    lists[0][i], lists[0][j] = lists[0][j], lists[0][i]
    with pytest.raises(ScheduleError, match="before F0@s0"):
        check_schedule(lists, 2, 2)


def test_checker_rejects_backward_before_forward():
    lists = [[a for a in rank if a.kind != "B" or a.mb] for rank in _gpipe()]
    for r, s in ((0, 0), (1, 1)):
        lists[r].insert(0, Backward(0, s))
    with pytest.raises(ScheduleError, match="before its forward"):
        check_schedule(lists, 2, 2)


def test_checker_rejects_receives_out_of_order():
    """Two activations from rank 0 to rank 1: the receives swapped would pair mb 1's data with
    mb 0's forward (silently wrong numbers under NCCL, which has no tags)."""
    lists = _gpipe()
    i, j = lists[1].index(Action(RECV_F, 0, 1)), lists[1].index(Action(RECV_F, 1, 1))
    lists[1][i], lists[1][j] = lists[1][j], lists[1][i]
    with pytest.raises(ScheduleError, match="matched in order"):
        check_schedule(lists, 2, 2)


def test_checker_finds_a_deadlock():
    """Rank 1 posts its receive for mb 0's gradient only after a forward that needs mb 1's input,
    which rank 0 sends only after it got that gradient (naive's strict alternation)."""
    p, m = 2, 2
    lists = Naive(p, m).actions()
    # Rank 0 runs B0 before sending mb 1's activation; make rank 1 wait for mb 1 before B0.
    r1 = [a for a in lists[1] if a.kind == "F" or a.kind == RECV_F]
    r1 += [a for a in lists[1] if a not in r1]
    with pytest.raises(ScheduleError, match="deadlock"):
        check_schedule([lists[0], r1], p, m)


def test_checker_rejects_a_receive_that_is_never_posted():
    lists = _gpipe()
    lists[0] = [a for a in lists[0] if a != Action(RECV_B, 1, 0)] + [Action(RECV_B, 1, 0)]
    with pytest.raises(ScheduleError, match="deadlock"):
        check_schedule(lists, 2, 2)


def test_bad_schedule_parameters():
    with pytest.raises(ScheduleError, match="multiple of pp"):
        Interleaved1F1B(4, 6, 2)
    with pytest.raises(ScheduleError, match="virtual stages need 'interleaved'"):
        OneFOneB(2, 4, 2)
    with pytest.raises(ScheduleError, match="unknown pipeline schedule"):
        make_schedule("zigzag", 2, 4)
    with pytest.raises(ScheduleError, match="different ranks"):
        Interleaved1F1B(1, 2, 2).actions()


def test_receives_are_posted_one_computation_ahead():
    """A 1F1B cycle's next input must be on its way while the current backward runs: the last
    stage posts mb 2's activation receive before B1 (ideal time would post it after), the first
    stage posts mb 1's gradient receive before B0. Measured: this removes a handshake of a few ms
    from each cycle's critical path on gloo."""
    lists = OneFOneB(2, 4).actions(receive_lookahead_for("cpu"))
    assert lists[1].index(Action(RECV_F, 2, 1)) < lists[1].index(Backward(1, 1))
    assert lists[0].index(Action(RECV_B, 1, 0)) < lists[0].index(Backward(0, 0))


@pytest.mark.parametrize("name,p,m,v", [c for c in CASES if c[1] > 1])
def test_early_receives_keep_each_senders_order(name, p, m, v):
    """Receives from one peer stay in the order that peer sends (no tags: order is the match)."""
    lists = make_schedule(name, p, m, v).actions(1)
    for r, actions in enumerate(lists):
        for src in range(p):
            received = [(a.mb, a.stage) for a in actions if a.kind in (RECV_F, RECV_B)
                        and (a.stage - 1 if a.kind == RECV_F else a.stage + 1) % p == src]
            sent = [(a.mb, _peer_stage(a)) for a in lists[src]
                    if a.kind in (SEND_F, SEND_B) and _peer_stage(a) % p == r]
            assert received == sent


def _peer_stage(send: Action) -> int:
    return send.stage + 1 if send.kind == SEND_F else send.stage - 1


def test_receive_buffers_bound_every_schedule():
    """The planner counts RECEIVE_BUFFERS boundary tensors per rank: the real lists reach it and
    never exceed it (p up to 8, m up to 32, v up to 4, both placements)."""
    from paratrain.perf.stages import RECEIVE_BUFFERS
    from paratrain.pipeline.schedules import peak_receives_posted

    for name in CLASSIC:
        peaks = [peak_receives_posted(actions, p * v)
                 for p in (2, 3, 4, 8) for m in (1, 2, 4, 8, 32)
                 for v in ((2, 3, 4) if name == "interleaved" else (1,))
                 if not (name == "interleaved" and m % p)
                 for lookahead in (0, 1)
                 for actions in make_schedule(name, p, m, v).actions(lookahead)]
        assert max(peaks) == RECEIVE_BUFFERS[name], name


@pytest.mark.parametrize("name,p,m,v", [c for c in CASES if c[1] > 1])
def test_gpu_placement_runs_on_stream_ordered_p2p(name, p, m, v):
    """On a GPU (NCCL: a rank's groups run in issue order on one stream) the ideal-time placement
    cannot deadlock."""
    s = make_schedule(name, p, m, v)
    assert receive_lookahead_for("cuda") == 0
    check_stream_order(s.actions(0), p, p * v)
    check_stream_order(s.forward_actions(0), p, p * v)


def test_early_receives_are_for_independent_p2p_only():
    """Receives posted a computation early are fine where operations are independent (gloo:
    check_schedule) but deadlock stream-ordered p2p: rank 0's receive of mb 0's gradient, posted
    with the send of mb 0's activation, holds back the send of mb 1's, which rank 1 needs before
    it can produce that gradient. So only the CPU places them early."""
    lists = OneFOneB(2, 4).actions(1)
    check_schedule(lists, 2, 4)
    with pytest.raises(ScheduleError, match="stream-ordered"):
        check_stream_order(lists, 2, 2)
    assert receive_lookahead_for("cpu") == 1
