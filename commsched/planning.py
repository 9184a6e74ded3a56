"""Rank 0 measures its timeline and the link, plans the order, and publishes it.

See [Note: the agreed order] in `commsched.scheduler`. Everything here runs at
agreed points, on every rank, so that the collectives line up: the calibration
at the end of warm-up's last profiled backward pass, the choice and the plan at
the start of the next one.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from commsched.autotune import Decision
from commsched.cost_model import Choice, Setting, Timeline, choose
from commsched.errors import wait_or_raise
from commsched.events import Observer
from commsched.layout import GradLayout
from commsched.lifecycle import WARMUP_ITERATIONS
from commsched.profile import fit_link
from commsched.scheduler import LinkModel, Partition, Plan, robust_plan, simulate_schedule
from commsched.strategy import Strategy
from commsched.transport.base import Handle

CALIBRATION_BYTES = 8 * 2**20
"""Largest all-reduce the cost model times to measure the link's bandwidth (once, at the end of warm-up)."""

CALIBRATION_REPEATS = 5
"""All-reduces timed per size to measure the link (see `link_from_samples`)."""

LATENCY_REPEATS = 10
"""One-element all-reduces timed for the round trip (see `measure_latency`)."""

LINK_SAFETY_FACTOR = 0.8
"""Plan for a link this much slower than measured: a partition planned too late costs
a little idle link time, one planned too early delays the next forward pass."""


class ReadyTimeProfile(Observer):
    """One rank's timeline of the warm-up backward passes (run without overlap).

    An observer of the core's events, recording iterations 1 to
    ``WARMUP_ITERATIONS - 1`` (the first is slow): when each parameter's
    gradient became ready (relative to the start of the backward pass), how long
    the forward pass before it took, and when each partition was issued and
    when the last one completed. The latter give the link's speed under the real
    load of training (computation competing with communication for the same
    cores): see `loaded_bytes_per_s`. Per parameter, not per bucket, so the
    timeline holds for any bucket layout the cost model considers.
    """

    def __init__(self, num_slots: int):
        self._num_slots = num_slots
        self._ready: list[list[float]] = []
        self._forward: list[float] = []
        self._transfers: list[tuple[list[tuple[float, int]], float]] = []
        """Per iteration: (when each partition was issued, its bytes), and when all had completed."""
        self._recording = False
        self._current: list[float] = []
        self._issued: list[tuple[float, int]] = []
        self._start = self._forward_start = 0.0

    def forward_started(self) -> None:
        self._forward_start = time.perf_counter()

    def iteration_started(self, iteration: int) -> None:
        self._recording = 0 < iteration < WARMUP_ITERATIONS
        if self._recording:
            self._start = time.perf_counter()
            if self._forward_start:
                self._forward.append(self._start - self._forward_start)
            self._current = [0.0] * self._num_slots
            self._issued = []

    def gradient_ready(self, slot: int) -> None:
        if self._recording:
            self._current[slot] = time.perf_counter() - self._start

    def partition_issued(self, partition: Partition, handle: Handle) -> None:
        if self._recording:
            self._issued.append((time.perf_counter() - self._start, partition.nbytes))

    def backward_finished(self) -> None:
        """During warm-up, every reduction of the iteration has completed by now."""
        if not self._recording:
            return
        self._recording = False
        self._ready.append(self._current)
        if self._issued:
            self._transfers.append((self._issued, time.perf_counter() - self._start))

    def median_slot_ready_s(self) -> list[float]:
        if not self._ready:
            return [0.0] * self._num_slots
        return [statistics.median(column) for column in zip(*self._ready)]

    def median_forward_s(self) -> float:
        return statistics.median(self._forward) if self._forward else 0.0

    def loaded_bytes_per_s(self, latency_s: float) -> float | None:
        """The link's bandwidth while training, median over the iterations that bound it.

        Per iteration, the bandwidth with which partitions reduced one after the
        other, each from when it was issued and costing ``latency_s`` besides its
        bytes, all complete when they were seen complete (`wire_bytes_per_s`).
        Bytes over the time from the first issue to the last completion would
        count the link's idle time, waiting for gradients, as transfer: where
        computation sets the pace that halves the bandwidth, and a plan made
        for so slow a link holds back partitions that would have fitted.
        None if no iteration bounds it (their last partition took no longer
        than a latency).
        """
        fitted = [wire_bytes_per_s(issued, done_s, latency_s) for issued, done_s in self._transfers]
        bounded = [b for b in fitted if b is not None]
        return statistics.median(bounded) if bounded else None


def wire_bytes_per_s(issued: Sequence[tuple[float, int]], done_s: float, latency_s: float) -> float | None:
    """The bandwidth ``b`` with which reductions issued at ``issued`` (time, bytes),
    each taking ``latency_s + bytes / b`` one after the other, all finish at ``done_s``.

    The finish time falls as ``b`` grows, so ``b`` is found by bisection on
    ``1 / b``. None where even an infinite bandwidth would not finish before
    ``done_s`` (the observation says nothing about the bandwidth).
    """
    if not issued:
        return None
    in_order = sorted(issued)

    def finish_s(seconds_per_byte: float) -> float:
        free_at = 0.0
        for at, nbytes in in_order:
            free_at = max(free_at, at) + latency_s + nbytes * seconds_per_byte
        return free_at

    if finish_s(0.0) >= done_s:
        return None
    low, high = 0.0, done_s / max(1, sum(nbytes for _, nbytes in in_order))  # finish_s(high) >= done_s
    for _ in range(60):
        middle = (low + high) / 2
        if finish_s(middle) < done_s:
            low = middle
        else:
            high = middle
    return 1.0 / high


def bucket_ready_s(slot_ready_s: Sequence[float], layout: GradLayout, held: frozenset[int]) -> list[float]:
    """When each bucket of ``layout`` is ready: its last gradient, or the end of the
    backward pass for the flags bucket and ``held`` ones (issued only then)."""
    end = max(slot_ready_s, default=0.0)
    return [
        end if b == layout.flags_bucket or b in held else max((slot_ready_s[s] for s in slots), default=0.0)
        for b, slots in enumerate(layout.bucket_slots)
    ]


def _timed_all_reduce(
    buffer: torch.Tensor, group: dist.ProcessGroup, timeout_s: float, what: str
) -> tuple[float, float]:
    """Wall time of one all-reduce of ``buffer``, and the CPU time of this process
    (every thread) per second of it. Collective."""
    start, cpu_start = time.perf_counter(), time.process_time()
    wait_or_raise(dist.all_reduce(buffer, group=group, async_op=True), timeout_s, what)
    wall = time.perf_counter() - start
    return wall, (time.process_time() - cpu_start) / max(wall, 1e-9)


def measure_latency(
    group: dist.ProcessGroup, device: torch.device, timeout_s: float, repeats: int = LATENCY_REPEATS
) -> float:
    """The quickest of ``repeats`` one-element all-reduces on ``device`` (collective: every rank calls it).

    The quickest, not the median: they run back to back within a millisecond or
    two, so one slow spell of either host (a descheduled thread) covers most of
    them, and noise only ever adds time. Their median was above 1 ms in 2 of 60
    calibrations of a 1 Gbit/s link whose round trip is 0.2 ms, and it is the
    floor of the fixed cost per collective (`measure_link`), so it made the cost
    model price every collective up to twenty times too high.
    """
    buffer, what = torch.zeros(1, device=device), "the latency measurement before agreeing on a plan"
    return min(_timed_all_reduce(buffer, group, timeout_s, what)[0] for _ in range(repeats))


def measure_link(
    group: dist.ProcessGroup, device: torch.device, nbytes: int, latency_s: float, timeout_s: float
) -> tuple[LinkModel, float]:
    """An all-reduce's cost as ``a + n / b`` at two sizes (``nbytes``, capped at
    `CALIBRATION_BYTES`, and an eighth of it), measured idle. Collective.

    ``a`` is the fixed cost of one collective at the sizes partitions have (the
    host's work and the link's latency), often well above a one-element round
    trip, and never taken below ``latency_s``, that round trip. Also returns the
    CPU time this process spends per second of the larger all-reduce (see
    `Timeline.transport_cpu_share`). The sizes take turns, after one untimed
    all-reduce each (the first of a size sets up the transport's buffers), so
    that a slow spell of the host slows both alike; see `link_from_samples`.
    """
    large = max(64, min(nbytes, CALIBRATION_BYTES)) // 4 * 4
    sizes = (large // 8 // 4 * 4, large)
    buffers = [torch.zeros(size // 4, device=device) for size in sizes]
    what = "the link measurement before choosing the partitioning"
    for buffer in buffers:
        _timed_all_reduce(buffer, group, timeout_s, what)
    samples = [[_timed_all_reduce(buffer, group, timeout_s, what) for buffer in buffers]
               for _ in range(CALIBRATION_REPEATS)]
    return link_from_samples(sizes, samples, latency_s)


def link_from_samples(
    sizes: Sequence[int], samples: Sequence[Sequence[tuple[float, float]]], latency_s: float
) -> tuple[LinkModel, float]:
    """The line (`fit_link`) through each size's median time, its fixed cost never below
    ``latency_s``, and the median CPU share of the largest size.

    ``samples`` holds one row per repeat: per size, (wall seconds, CPU share).
    The fixed cost is the line extrapolated to zero bytes, so an error in one
    size's time moves it several times over. Medians of 3, the smaller size's
    all timed before the larger's, once gave 2.4 ms per collective where other
    clusters of the same cell gave 0.2 to 0.4, and the cost model chose
    partitions four times larger for it; medians of `CALIBRATION_REPEATS` keep
    a slow spell of two samples out of the fit.
    """
    medians = [statistics.median(wall for wall, _ in column) for column in zip(*samples)]
    fixed_s, bytes_per_s = fit_link(sizes, medians, latency_s)
    largest = max(range(len(sizes)), key=lambda i: sizes[i])
    cpu_share = statistics.median(row[largest][1] for row in samples)
    return LinkModel(latency_s=fixed_s, bytes_per_s=bytes_per_s), min(1.0, cpu_share)


@dataclass(frozen=True)
class Calibration:
    """The link, measured idle once per model: see `calibrate`."""

    latency_s: float
    """A one-element all-reduce's time, as this rank measured it."""
    link: LinkModel | None = None
    """An all-reduce's cost by size (None where the cost model does not run)."""
    transport_cpu_share: float = 0.0
    """See `Timeline.transport_cpu_share`."""


def calibrate(layout: GradLayout, group: dist.ProcessGroup, timeout_s: float, with_link: bool) -> Calibration:
    """Time the link on ``group`` with tensors on the gradients' device. Collective.

    Runs where memory is lowest, at the end of warm-up's last profiled backward
    pass: every reduction is complete and the activations are freed. Its
    all-reduces of up to `CALIBRATION_BYTES` would otherwise add to the peak
    of a backward pass, with every activation alive.
    """
    device = layout.buckets[0].flat.device
    latency_s = measure_latency(group, device, timeout_s)
    if not with_link:
        return Calibration(latency_s)
    link, cpu_share = measure_link(group, device, sum(b.nbytes for b in layout.buckets), latency_s, timeout_s)
    return Calibration(latency_s, link, cpu_share)


def choose_on_rank0(
    layout: GradLayout,
    profile: ReadyTimeProfile,
    calibration: Calibration,
    strategy: Strategy,
    control_group: dist.ProcessGroup,
) -> tuple[Choice, Timeline | None]:
    """Rank 0 runs the cost model; every rank gets its setting. See [Note: the cost model].

    Collective: the choice goes out on ``control_group``. ``calibration`` must
    hold the link (`calibrate` with ``with_link``). Returns rank 0's `Choice`
    (on other ranks, its setting only), and on rank 0 the timeline the cost
    model saw (None elsewhere).
    """
    if calibration.link is None:
        raise ValueError("the cost model needs the link: calibrate(..., with_link=True)")
    choice = timeline = None
    message = torch.zeros(2, dtype=torch.float64)
    if dist.get_rank(control_group) == 0:
        timeline = Timeline(tuple(profile.median_slot_ready_s()), profile.median_forward_s(), calibration.link,
                            calibration.transport_cpu_share)
        choice = choose(strategy, layout.params, layout.forward_order, timeline)
        message = torch.tensor([_encode_mb(choice.setting.partition_mb), _encode_mb(choice.setting.credit_mb)],
                               dtype=torch.float64)
    if dist.get_world_size(control_group) > 1:
        work = dist.broadcast(message, group=control_group, group_src=0, async_op=True)
        wait_or_raise(work, strategy.timeout_s, "the broadcast of rank 0's choice of partitions")
    if choice is None:
        choice = Choice(Setting(_decode_mb(message[0]), _decode_mb(message[1])), ())
    return choice, timeline


def _encode_mb(value: float | None) -> float:
    return -1.0 if value is None else value


def _decode_mb(value: torch.Tensor) -> float | None:
    return None if float(value) < 0 else float(value)


def link_sets_the_pace(
    partitions: Sequence[Partition], last_ready_s: float, forward_s: float, link: LinkModel | None
) -> bool:
    """Whether reducing every partition on ``link`` takes at least as long as the
    computation of an iteration (the backward pass so far and the forward pass).

    False without a measured link: the cautious plan (see `robust_plan`).
    """
    if link is None:
        return False
    wire_s = sum(link.duration_s(p.nbytes) for p in partitions)
    return wire_s >= last_ready_s + forward_s


def pacing_link(warmup: WarmupTimeline) -> LinkModel | None:
    """The link `link_sets_the_pace` judges by: idle, where the cost model measured it;
    otherwise as warm-up saw it (`ReadyTimeProfile.loaded_bytes_per_s`).

    Without the cost model (``Strategy(adaptive=False)``, parameter servers) the
    warm-up's fit is all there is. For parameter servers it is the right
    measure anyway: a block's "transfer" is its push, the other workers'
    pushes and its pull through the busiest server's link, which no
    all-reduce on an idle link measures.
    """
    if warmup.idle_link is not None:
        return warmup.idle_link
    if warmup.loaded_bytes_per_s is None:
        return None
    return LinkModel(latency_s=warmup.latency_s, bytes_per_s=warmup.loaded_bytes_per_s)


def planning_bytes_per_s(warmup: WarmupTimeline) -> float:
    """The bandwidth plans assume: the one seen while training, never above the idle
    link's (where measured), times `LINK_SAFETY_FACTOR`; unbounded if neither is known."""
    bytes_per_s = warmup.loaded_bytes_per_s
    if warmup.idle_link is not None:
        bytes_per_s = min(bytes_per_s or math.inf, warmup.idle_link.bytes_per_s)
    return (bytes_per_s or 1e12) * LINK_SAFETY_FACTOR


def plan_order(
    partitions: Sequence[Partition], bucket_ready: Sequence[float], warmup: WarmupTimeline, credit_bytes: int | None
) -> list[int]:
    """Rank 0's plan: priority scheduling simulated on its timeline, hardened by `robust_plan`."""
    link = LinkModel(latency_s=warmup.latency_s, bytes_per_s=planning_bytes_per_s(warmup))
    schedule = simulate_schedule(partitions, bucket_ready, link, credit_bytes, by_priority=True)
    last_ready = max(bucket_ready, default=0.0)
    pace = link_sets_the_pace(partitions, last_ready, warmup.forward_s, pacing_link(warmup))
    return robust_plan(partitions, schedule, last_ready, pace)


def plan_on_rank0(
    partitions: Sequence[Partition],
    bucket_ready: Sequence[float],
    warmup: WarmupTimeline,
    credit_bytes: int | None,
    group: dist.ProcessGroup,
    timeout_s: float,
) -> Plan:
    """Simulate priority scheduling on rank 0's timeline; broadcast rank 0's plan.

    Collective: every rank calls it at the same point; a peer that does not
    raises `CommunicationTimeout` after ``timeout_s``. The link is modelled by
    the measured latency and the bandwidth seen while training
    (`planning_bytes_per_s`); if the link is
    faster than that, non-urgent partitions merely go a little later, never
    ahead of urgent ones. Where the link is slower than the computation
    (`link_sets_the_pace` on `pacing_link`), the plan keeps the link busy to the end of the
    backward pass instead (see `robust_plan`).
    """
    plan = torch.tensor(plan_order(partitions, bucket_ready, warmup, credit_bytes), dtype=torch.int64)
    if dist.get_world_size(group) > 1:
        work = dist.broadcast(plan, group=group, group_src=0, async_op=True)
        wait_or_raise(work, timeout_s, "the broadcast of rank 0's plan")
    return Plan(tuple(partitions), tuple(plan.tolist()), credit_bytes, agreed=True)


@dataclass(frozen=True)
class WarmupTimeline:
    """What a plan for any layout needs from warm-up, kept when the profile is dropped
    (the auto-tuner plans each setting it tries from it)."""

    slot_ready_s: tuple[float, ...]
    loaded_bytes_per_s: float | None
    latency_s: float
    forward_s: float = 0.0
    idle_link: LinkModel | None = None
    """The link as the cost model measured it, idle (rank 0, when it ran)."""

    @classmethod
    def of(cls, profile: ReadyTimeProfile, latency_s: float, idle_link: LinkModel | None = None) -> WarmupTimeline:
        return cls(tuple(profile.median_slot_ready_s()), profile.loaded_bytes_per_s(latency_s), latency_s,
                   profile.median_forward_s(), idle_link)


def agree_on_decision(decision: Decision | None, group: dist.ProcessGroup, timeout_s: float) -> Decision:
    """Rank 0's auto-tuning `Decision` on every rank (``decision``: rank 0's, None elsewhere).

    Collective over ``group`` (the control group), at a switch point every rank
    knows; see [Note: auto-tuning].
    """
    message = torch.zeros(Decision.LENGTH, dtype=torch.float64)
    if decision is not None:
        message = torch.tensor(decision.encode(), dtype=torch.float64)
    if dist.get_world_size(group) > 1:
        work = dist.broadcast(message, group=group, group_src=0, async_op=True)
        wait_or_raise(work, timeout_s, "the broadcast of rank 0's auto-tuning decision")
    return decision if decision is not None else Decision.decode(message.tolist())
