"""The link a plan assumes: measured from the warm-up's transfers, not from its idle time."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commsched.device import HostSeam
from commsched.engine.ready_times import ReadyTimeProfile
from commsched.engine.dispatch import PlanExecutor
from commsched.layout.partitions import Partition, Plan, make_partitions
from commsched.planning import calibration, plans
from commsched.planning.plans import WarmupTimeline, plan_order, planning_bytes_per_s, wire_bytes_per_s
from commsched.planning.schedule import LinkModel


def sequential_finish_s(issued: list[tuple[float, int]], latency_s: float, bytes_per_s: float) -> float:
    """When reductions issued at ``issued`` finish, one after the other."""
    free_at = 0.0
    for at, nbytes in sorted(issued):
        free_at = max(free_at, at) + latency_s + nbytes / bytes_per_s
    return free_at


@settings(max_examples=200, deadline=None)
@given(
    issued=st.lists(st.tuples(st.floats(0.0, 0.5), st.integers(1, 8 * 2**20)), min_size=1, max_size=20),
    latency_s=st.floats(0.0, 0.005),
    bytes_per_s=st.floats(1e6, 1e10),
)
def test_the_fitted_bandwidth_explains_the_observed_finish(issued, latency_s, bytes_per_s):
    done_s = sequential_finish_s(issued, latency_s, bytes_per_s)
    fitted = wire_bytes_per_s(issued, done_s, latency_s)
    if fitted is None:  # the bytes took no measurable time at all, or the last busy period held few of them
        no_time = done_s - sequential_finish_s(issued, latency_s, math.inf) < 1e-12 * max(1.0, done_s)
        last_busy = last_busy_bytes(issued, latency_s, bytes_per_s)
        assert no_time or last_busy < plans.BOUNDING_SHARE * sum(n for _, n in issued) * (1 + 1e-9)
    else:
        assert sequential_finish_s(issued, latency_s, fitted) == pytest.approx(done_s, rel=1e-9, abs=1e-12)


def last_busy_bytes(issued: list[tuple[float, int]], latency_s: float, bytes_per_s: float) -> int:
    """The bytes reduced since the link was last idle when one was issued."""
    free_at, busy = 0.0, 0
    for at, nbytes in sorted(issued):
        busy = nbytes if at >= free_at else busy + nbytes
        free_at = max(free_at, at) + latency_s + nbytes / bytes_per_s
    return busy


def test_idle_time_between_gradients_is_not_counted_as_transfer():
    # 1 MB when the first gradient is ready, 1 MB 100 ms later, at 100 MB/s: the
    # link is busy 20 of the 110 ms.
    issued = [(0.0, 10**6), (0.1, 10**6)]
    assert wire_bytes_per_s(issued, 0.11, latency_s=0.0) == pytest.approx(1e8)


def test_a_small_last_transfer_on_an_idle_link_bounds_nothing():
    """Where the link idles before the input-side bucket, only that bucket's time binds the
    fit: a host's few ms of delay there read as a link several times slower than it is."""
    issued = [(0.0, 4 * 10**6), (0.1, 2 * 10**5)]  # 4 MB, then 0.2 MB on a link idle at 100 MB/s
    for late_s in (0.0, 0.004):  # on time, or 4 ms late (read alone: 33 MB/s)
        assert wire_bytes_per_s(issued, 0.102 + late_s, latency_s=0.0, idle_bytes_per_s=1e8) is None
    # Without the idle link's speed, a finish as late as a slow link would make binds the fit.
    assert wire_bytes_per_s(issued, 0.2, latency_s=0.0) == pytest.approx(4.2e6 / 0.2)
    # Where the link is busy to the end, the bytes bind it: half of the idle speed, seen as such.
    backlogged = [(0.0, 2 * 10**5), (0.001, 4 * 10**6)]
    assert wire_bytes_per_s(backlogged, 0.084, latency_s=0.0, idle_bytes_per_s=1e8) == pytest.approx(5e7, rel=0.01)


def test_a_finish_that_latency_alone_explains_bounds_nothing():
    assert wire_bytes_per_s([(0.0, 10**6)], done_s=0.001, latency_s=0.002) is None
    assert wire_bytes_per_s([], done_s=0.1, latency_s=0.0) is None


def test_the_plan_never_assumes_a_link_faster_than_idle():
    idle = LinkModel(latency_s=0.001, bytes_per_s=1e8)
    fast = WarmupTimeline((0.0,), loaded_bytes_per_s=5e8, latency_s=0.001, idle_link=idle)
    slow = WarmupTimeline((0.0,), loaded_bytes_per_s=5e7, latency_s=0.001, idle_link=idle)
    unknown = WarmupTimeline((0.0,), loaded_bytes_per_s=None, latency_s=0.001, idle_link=idle)
    assert planning_bytes_per_s(fast) == pytest.approx(1e8)
    assert planning_bytes_per_s(slow) == pytest.approx(5e7)
    assert planning_bytes_per_s(unknown) == pytest.approx(1e8)


class FakeClock(HostSeam):
    """The host's seam, with a clock the test sets."""

    def __init__(self) -> None:
        self.now = 0.0

    def stamp(self) -> float:
        return self.now


# A VGG-like model as the bench measured it at 1 Gbit/s: the classifier's
# buckets (output side, most bytes) ready early, the convolutions' over the
# backward pass, the input-side bucket last.
BUCKET_BYTES = [2 * 1196564, 9 * 1048918, 1327872, 1162752, 88584]
BUCKET_PRIORITIES = [14, 12, 10, 4, 0]
BUCKET_READY_S = [0.0026, 0.0137, 0.0496, 0.1415, 0.2218]
LINK = LinkModel(latency_s=0.0017, bytes_per_s=119.5e6)


def warm_up(
    monkeypatch, partitions: list[Partition], ready_s: list[float] = BUCKET_READY_S, link: LinkModel = LINK,
    forward_s: float = 0.1,
) -> ReadyTimeProfile:
    """Two profiled warm-up iterations: each partition issued in bucket order once its
    bucket is ready, as warm-up does, reduced one after the other on ``link``."""
    clock = FakeClock()
    profile = ReadyTimeProfile(num_slots=len(BUCKET_READY_S), clock=clock)
    start = 0.0
    for iteration in (1, 2):
        clock.now = start - forward_s
        profile.forward_started()
        clock.now = start
        profile.iteration_started(iteration)
        issued = []
        for partition in partitions:  # bucket order
            clock.now = start + ready_s[partition.bucket]
            profile.gradient_ready(partition.bucket)
            profile.partition_issued(partition, handle=None)
            issued.append((ready_s[partition.bucket], partition.nbytes))
        clock.now = start + sequential_finish_s(issued, link.latency_s, link.bytes_per_s)
        profile.backward_finished()
        start = clock.now + 1.0
    return profile


def test_a_computation_paced_plan_sends_early_gradients_before_the_backward_pass_ends(monkeypatch):
    """Warm-up's link is idle most of the backward pass, waiting for gradients. Taken
    for transfer time, that idle time made the plan assume a link three times slower
    than it is, and hold early buckets' partitions behind the last bucket, until the
    backward pass ended, while the link idled."""
    sizes = [4] * len(BUCKET_BYTES)
    partitions = make_partitions([b // 4 for b in BUCKET_BYTES], sizes, BUCKET_PRIORITIES, 2**20)
    profile = warm_up(monkeypatch, partitions)
    # The input-side bucket goes out alone on an idle link: the warm-up's transfers do not
    # bound the link's speed, and the plan takes the idle link's.
    warmup = profile.timeline(LINK.latency_s, idle_link=LINK)
    assert warmup.loaded_bytes_per_s is None
    assert planning_bytes_per_s(warmup) == pytest.approx(LINK.bytes_per_s)

    order = plan_order(partitions, BUCKET_READY_S, warmup, credit_bytes=4 * 2**20)
    position = {pid: index for index, pid in enumerate(order)}
    last_bucket = [p.pid for p in partitions if p.bucket == len(BUCKET_BYTES) - 1]
    early_buckets = [p.pid for p in partitions if BUCKET_READY_S[p.bucket] < 0.05]
    assert max(position[pid] for pid in early_buckets) < min(position[pid] for pid in last_bucket), order


def positions(order: list[int]) -> dict[int, int]:
    return {pid: index for index, pid in enumerate(order)}


def test_without_an_idle_measurement_a_slow_link_is_kept_busy_during_the_backward_pass(monkeypatch):
    """Parameter servers (and ``adaptive=False``) have no idle measurement of the link.
    The ResNet-like on one server at 0.25 Gbit/s: a block's round trip (both workers'
    pushes through the server's link, then the pulls) runs at about 11 MB/s, so the
    blocks take four times the computation. The cautious plan held every block behind
    the input-side bucket, ready last: the link idled through the backward pass, every
    block then went at once, and the next forward pass waited for all of them."""
    bucket_bytes = [1186856, 1181696, 1068544, 1183744, 717632]
    ready_s = [0.004, 0.007, 0.012, 0.025, 0.064]
    round_trip = LinkModel(latency_s=0.002, bytes_per_s=11e6)
    partitions = make_partitions([b // 4 for b in bucket_bytes], [4] * 5, [4, 3, 2, 1, 0], 2**20)
    profile = warm_up(monkeypatch, partitions, ready_s, round_trip, forward_s=0.04)
    warmup = profile.timeline(round_trip.latency_s)  # no idle link
    assert warmup.idle_link is None
    assert warmup.loaded_bytes_per_s == pytest.approx(round_trip.bytes_per_s, rel=1e-6)

    order = plan_order(partitions, ready_s, warmup, credit_bytes=4 * 2**20)
    position = positions(order)
    last_bucket = [p.pid for p in partitions if p.bucket == 4]
    first_ready = [p.pid for p in partitions if p.bucket == 0]
    assert max(position[pid] for pid in first_ready) < min(position[pid] for pid in last_bucket), order


def link_samples(sizes: tuple[int, int], fixed_s: float, bytes_per_s: float, slow: dict[tuple[int, int], float]):
    """`CALIBRATION_REPEATS` rows of (wall, CPU share) per size on the line, plus ``slow[(row, size)]`` seconds."""
    return [[(fixed_s + n / bytes_per_s + slow.get((row, i), 0.0), 0.1 + 0.01 * row) for i, n in enumerate(sizes)]
            for row in range(calibration.CALIBRATION_REPEATS)]


def test_the_link_calibration_keeps_a_slow_spell_out_of_the_fixed_cost():
    sizes = (2**20, 2**23)  # the cost model's sizes for gradients of 8 MiB or more
    fixed_s, bytes_per_s, latency_s = 0.2e-3, 119e6, 0.15e-3

    def calibrated(slow):
        return calibration.link_from_samples(sizes, link_samples(sizes, fixed_s, bytes_per_s, slow), latency_s)

    link, cpu_share = calibrated({})
    assert link.latency_s == pytest.approx(fixed_s) and link.bytes_per_s == pytest.approx(bytes_per_s)
    assert cpu_share == pytest.approx(0.12)  # the median row's share of the larger size
    # Two of the smaller size's samples 3 ms slow: a median of three would take one
    # of them, and the line through it would put the fixed cost near 3.6 ms.
    link, _ = calibrated({(0, 0): 3e-3, (1, 0): 3e-3})
    assert link.latency_s == pytest.approx(fixed_s) and link.bytes_per_s == pytest.approx(bytes_per_s)


def test_a_link_calibration_whose_times_do_not_grow_gives_a_finite_bandwidth():
    # Noise can make the larger all-reduce the quicker; the two-point difference
    # then gave a bandwidth of petabytes per second.
    sizes = (2**20, 2**23)
    samples = [[(5e-3, 0.1), (4e-3, 0.1)] for _ in range(calibration.CALIBRATION_REPEATS)]
    link, _ = calibration.link_from_samples(sizes, samples, latency_s=1e-4)
    assert link.latency_s == pytest.approx(1e-4)
    assert link.bytes_per_s == pytest.approx(2**23 / (4e-3 - 1e-4))


def test_without_forward_overlap_no_ready_partition_waits_behind_the_last_bucket():
    """[Note: a plan without urgency] On a link the plan takes for slow, the priority plan leaves what
    it could not start during the backward pass to go most urgent first: the input side's bucket,
    ready only at the end, goes first and everything ready before it waits. Without forward overlap
    nothing needs that bucket first: the plan is the order of readiness, and an executor fed every
    bucket but the last has issued every other partition (no credit window to wait for)."""
    sizes = [4] * len(BUCKET_BYTES)
    partitions = make_partitions([b // 4 for b in BUCKET_BYTES], sizes, BUCKET_PRIORITIES, 2**20)
    slow = LinkModel(latency_s=LINK.latency_s, bytes_per_s=LINK.bytes_per_s / 20)
    # only the link matters to the plan here: the buckets' ready times are given to plan_order
    timeline = WarmupTimeline(slot_ready_s=(), loaded_bytes_per_s=slow.bytes_per_s, latency_s=slow.latency_s)
    last = len(BUCKET_BYTES) - 1
    last_bucket = {p.pid for p in partitions if p.bucket == last}

    def issued_before_the_end(order: list[int]) -> set[int]:
        executor = PlanExecutor(Plan(tuple(partitions), tuple(order), credit_bytes=None, agreed=True))
        launched: list[int] = []
        for bucket in range(last):
            executor.mark_ready(bucket)
            executor.pump(lambda p: launched.append(p.pid) or p.pid, lambda handle: False)
        return set(launched)

    urgent_first = plan_order(partitions, BUCKET_READY_S, timeline, credit_bytes=4 * 2**20)
    # the hazard: with overlap, the priority plan holds ready partitions behind the last bucket
    assert issued_before_the_end(urgent_first) != {p.pid for p in partitions} - last_bucket
    by_readiness = plan_order(partitions, BUCKET_READY_S, timeline, credit_bytes=4 * 2**20, overlapping=False)
    assert sorted(by_readiness) == [p.pid for p in partitions]
    assert issued_before_the_end(by_readiness) == {p.pid for p in partitions} - last_bucket
    ready_at = [BUCKET_READY_S[partitions[pid].bucket] for pid in by_readiness]
    assert ready_at == sorted(ready_at)
