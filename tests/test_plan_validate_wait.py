"""`plan --cluster local --validate` explains a measured rate below the prediction (issue 35 item 8):
the prediction is for whole cores, and on a shared host the workers wait in the run queue; the
validation reports that wait (Linux schedstat) and the measured rate with it taken out
(plan_cli/cpu_wait.py). No timing is asserted: the wait itself is whatever the host does."""

from __future__ import annotations

from paratrain.plan_cli import Measured, validate_table
from paratrain.plan_cli.cpu_wait import Wait, at_full_cores, busiest_fraction, timed_wait, waited_ns


def test_the_wait_is_taken_out_of_the_wall_time():
    assert Wait(wall_s=4.0, waited_s=2.0).fraction == 0.5
    assert Wait(wall_s=4.0, waited_s=None).fraction is None
    assert at_full_cores(1000.0, 0.5) == 2000.0  # half the run waiting: twice the rate on whole cores
    assert at_full_cores(1000.0, None) is None
    assert busiest_fraction([Wait(4.0, 1.0), Wait(4.0, 2.0), Wait(4.0, None)]) == 0.5
    assert busiest_fraction([Wait(4.0, None)]) is None


def test_the_table_shows_the_wait_and_the_rate_at_full_cores():
    text = validate_table([("dp2 tp1 pp1 zero0 mb8", 3000.0, Measured(1200.0, 1100.0, 1300.0, waited=0.6)),
                           ("dp2 tp1 pp1 zero3 mb8", 3000.0, Measured(1500.0, 1400.0, 1600.0))])
    first, second = text.splitlines()[1:3]
    assert first.split()[-3:] == ["0.40", "60%", "1.00"]  # 1200 / 3000; 1200 / 0.4 = 3000
    assert second.split()[-3:] == ["0.50", "?", "?"]  # not known: nothing claimed
    assert "waiting for a CPU" in text and "measured / (1 - waited)" in text


def test_this_thread_s_wait_is_read_where_linux_counts_it():
    before = waited_ns()
    value, wait = timed_wait(lambda: sum(range(1000)))
    assert value == 499500 and wait.wall_s >= 0
    if before is None:  # no schedstat here: nothing claimed
        assert wait.waited_s is None
    else:
        assert isinstance(before, int) and 0.0 <= wait.waited_s
