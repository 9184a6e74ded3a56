"""The scheduler's pure logic: partitions, the simulated plan, the executor."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commsched.engine.dispatch import PlanExecutor
from commsched.layout.partitions import Plan, fifo_plan, make_partitions
from commsched.planning.schedule import LinkModel, SimulatedSchedule, robust_plan, simulate_schedule
from commsched.planning.wire import wire_share


@settings(max_examples=200, deadline=None)
@given(
    numels=st.lists(st.integers(min_value=1, max_value=5000), min_size=1, max_size=12),
    partition_bytes=st.one_of(st.none(), st.integers(min_value=1, max_value=8000)),
)
def test_partitions_tile_every_bucket_within_the_size(numels, partition_bytes):
    partitions = make_partitions(numels, [4] * len(numels), list(range(len(numels))), partition_bytes)
    assert [p.pid for p in partitions] == list(range(len(partitions)))
    for bucket, numel in enumerate(numels):
        mine = [p for p in partitions if p.bucket == bucket]
        assert mine[0].start == 0 and mine[-1].end == numel
        assert all(a.end == b.start for a, b in zip(mine, mine[1:]))
        assert all(p.end > p.start for p in mine)
        if partition_bytes is None:
            assert len(mine) == 1
        else:
            # about the partition size: never above 1.5 times it (or one element)
            assert all(p.nbytes <= max(1.5 * partition_bytes, 4) for p in mine)
            # and never cut when the bucket is within a quarter of the size
            if numel * 4 <= 1.25 * partition_bytes:
                assert len(mine) == 1
            # pieces are as equal as possible: at most one element apart
            sizes = [p.end - p.start for p in mine]
            assert max(sizes) - min(sizes) <= 1


def test_fifo_plan_is_bucket_order():
    partitions = make_partitions([10, 10], [4, 4], [5, 0], 12)
    assert [p.bucket for p in partitions] == [0, 0, 0, 1, 1, 1]
    assert fifo_plan(partitions) == [0, 1, 2, 3, 4, 5]


LINK = LinkModel(latency_s=0.0, bytes_per_s=100.0)  # 1 byte = 10 ms


def two_buckets():
    # bucket 0: 400 bytes, ready first, needed last; bucket 1: 100 bytes, ready at 1.0 s, urgent
    return make_partitions([100, 25], [4, 4], [9, 0], 100)


def test_urgent_partition_overtakes_under_credit():
    partitions = two_buckets()
    schedule = simulate_schedule(partitions, [0.0, 1.0], LINK, credit_bytes=100, by_priority=True)
    # At 1.0 s bucket 0's first partition (1 s each) is done, and the urgent one goes next.
    assert schedule.order == [0, 4, 1, 2, 3]
    assert schedule.finish_s[4] == pytest.approx(2.0)


def test_without_priority_order_is_fifo():
    partitions = two_buckets()
    schedule = simulate_schedule(partitions, [0.0, 1.0], LINK, credit_bytes=100, by_priority=False)
    assert schedule.order == [0, 1, 2, 3, 4]


def test_without_credit_everything_ready_is_committed():
    partitions = two_buckets()
    schedule = simulate_schedule(partitions, [0.0, 1.0], LINK, credit_bytes=None, by_priority=True)
    assert schedule.order == [0, 1, 2, 3, 4]
    assert schedule.finish_s[4] == pytest.approx(5.0)


@settings(max_examples=100, deadline=None)
@given(
    numels=st.lists(st.integers(min_value=1, max_value=400), min_size=1, max_size=8),
    ready=st.lists(st.floats(min_value=0, max_value=5), min_size=8, max_size=8),
    credit=st.one_of(st.none(), st.integers(min_value=1, max_value=2000)),
    by_priority=st.booleans(),
)
def test_simulation_issues_each_partition_once_never_before_ready(numels, ready, credit, by_priority):
    partitions = make_partitions(numels, [4] * len(numels), list(range(len(numels)))[::-1], 256)
    schedule = simulate_schedule(partitions, ready[: len(numels)], LINK, credit, by_priority)
    assert partitions and sorted(schedule.order) == list(range(len(partitions)))
    for p in partitions:
        duration = LINK.duration_s(p.nbytes)
        assert schedule.finish_s[p.pid] >= ready[p.bucket] + duration - 1e-9
    # the link carries one partition at a time, in issue order
    finishes = [schedule.finish_s[pid] for pid in schedule.order]
    assert finishes == sorted(finishes)


def test_robust_plan_moves_late_partitions_behind_urgent_ones():
    partitions = two_buckets()
    schedule = SimulatedSchedule(order=[0, 1, 4, 2, 3], finish_s={0: 1.0, 1: 2.0, 4: 3.0, 2: 4.0, 3: 5.0},
                                 start_s={0: 0.0, 1: 1.0, 4: 2.0, 2: 3.0, 3: 4.0})
    # What gets the link before the last bucket is ready keeps its place; the rest goes most urgent first.
    assert robust_plan(partitions, schedule, last_ready_s=1.5) == [0, 1, 4, 2, 3]
    assert robust_plan(partitions, schedule, last_ready_s=1.0) == [0, 4, 1, 2, 3]


def test_robust_plan_keeps_the_link_busy_until_the_backward_pass_ends():
    """A partition that starts before the end keeps its place even if it runs past it: moving it
    behind the urgent bucket would leave the link idle ([Note: keeping the link busy])."""
    partitions = two_buckets()
    link = LinkModel(latency_s=0.0, bytes_per_s=100.0)  # 1 s per partition
    ready = [0.0, 2.5]  # bucket 0 early; bucket 1 (the urgent one) at the end of backward
    schedule = simulate_schedule(partitions, ready, link, credit_bytes=None, by_priority=True)
    plan = robust_plan(partitions, schedule, last_ready_s=2.5)
    started_before_end = [pid for pid in schedule.order if schedule.start_s[pid] < 2.5]
    assert plan[: len(started_before_end)] == started_before_end
    assert any(schedule.finish_s[pid] > 2.5 for pid in started_before_end)
    # at most one kept partition runs past the end
    assert sum(schedule.finish_s[pid] > 2.5 for pid in started_before_end) == 1
    # none of the first bucket's partitions that had not started waits ahead of the urgent one
    assert plan[len(started_before_end)] == 4


class FakeLink:
    """Records launches; the test decides when each completes."""

    def __init__(self):
        self.launched: list[int] = []
        self.completed: set[int] = set()

    def launch(self, partition):
        self.launched.append(partition.pid)
        return partition.pid

    def is_completed(self, handle) -> bool:
        return handle in self.completed


def test_executor_follows_the_plan_blocks_on_readiness_and_credit():
    partitions = make_partitions([100, 25], [4, 4], [9, 0], 100)  # four of 100 B, one of 100 B
    link = FakeLink()
    executor = PlanExecutor(Plan(tuple(partitions), (0, 4, 1, 2, 3), credit_bytes=200))
    executor.mark_ready(0)
    executor.pump(link.launch, link.is_completed)
    assert link.launched == [0]  # 4 is next in the plan but its bucket is not ready: no skipping
    executor.mark_ready(1)
    executor.pump(link.launch, link.is_completed)
    assert link.launched == [0, 4]  # 200 bytes in flight: the window is full
    executor.pump(link.launch, link.is_completed)
    assert link.launched == [0, 4]
    link.completed.add(0)
    executor.pump(link.launch, link.is_completed)
    assert link.launched == [0, 4, 1]
    executor.pump(link.launch, link.is_completed, ignore_credit=True)
    assert link.launched == [0, 4, 1, 2, 3] and executor.done


def test_a_partition_that_completes_out_of_order_returns_its_credit():
    partitions = make_partitions([100, 25], [4, 4], [9, 0], 100)
    link = FakeLink()
    executor = PlanExecutor(Plan(tuple(partitions), (0, 1, 2, 3, 4), credit_bytes=200))
    executor.mark_ready(0)
    executor.pump(link.launch, link.is_completed)
    assert link.launched == [0, 1]
    link.completed.add(1)  # gloo's two threads: the second finishes first
    executor.pump(link.launch, link.is_completed)
    assert link.launched == [0, 1, 2]


def test_a_partition_larger_than_the_window_goes_alone():
    partitions = make_partitions([100], [4], [0], 400)
    link = FakeLink()
    executor = PlanExecutor(Plan(tuple(partitions), (0,), credit_bytes=10))
    executor.mark_ready(0)
    executor.pump(link.launch, link.is_completed)
    assert link.launched == [0]


def test_executor_rejects_a_plan_that_misses_partitions():
    partitions = make_partitions([100], [4], [0], 100)
    with pytest.raises(ValueError, match="every partition exactly once"):
        Plan(tuple(partitions), (0, 0, 1), credit_bytes=None)


def test_two_in_flight_take_turns_step_by_step():
    """[Note: two collectives at once]: with ``in_flight`` 2 a second partition goes at once and the two
    take turns: a round lasts the longer one alone or both on the wire, where one at a time the second
    would wait for the first."""
    link = LinkModel(latency_s=0.5, bytes_per_s=400.0, in_flight=2)  # 400 bytes: 0.5 s fixed + 1 s on the wire
    partitions = make_partitions([300], [4], [0], 400)  # three partitions of 400 bytes
    one = link.duration_s(400)
    assert wire_share(one, link.latency_s) == pytest.approx(2 / 3)
    schedule = simulate_schedule(partitions, [0.0], link, credit_bytes=None, by_priority=True)
    both_on_the_wire = 2 * (one - link.latency_s)  # longer than one alone: the wire sets the pace
    assert schedule.start_s == pytest.approx({0: 0.0, 1: 0.0, 2: both_on_the_wire})  # the third waits for a place
    assert schedule.finish_s == pytest.approx({0: both_on_the_wire, 1: both_on_the_wire, 2: both_on_the_wire + one})
    # A small one behind a large one takes a turn per turn of the large one: they finish together.
    small_behind_large = make_partitions([1000, 10], [4, 4], [0, 1], None)
    schedule = simulate_schedule(small_behind_large, [0.0, 0.0], link, credit_bytes=None, by_priority=False)
    assert schedule.finish_s == pytest.approx({0: link.duration_s(4000), 1: link.duration_s(4000)})
    serial = simulate_schedule(partitions, [0.0], LinkModel(0.5, 400.0), credit_bytes=None, by_priority=True)
    assert serial.finish_s == pytest.approx({0: one, 1: 2 * one, 2: 3 * one})
    assert serial.start_s == pytest.approx({0: 0.0, 1: one, 2: 2 * one})
