"""The link, timed once per model at the end of warm-up: the latency, and an all-reduce's cost by size.

Collective: every rank times the same all-reduces, at the end of warm-up's last
profiled backward pass, where memory is lowest.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from commsched.comm.two_step import SecondSteps, TwoStepAllReduce
from commsched.device import HostSeam
from commsched.errors import wait_or_raise
from commsched.layout.grad_layout import GradLayout
from commsched.planning.schedule import LinkModel
from commsched.profiling.link import collectives_in_flight
from commsched.profiling.profile import fit_link

HOST = HostSeam()
"""The host's clock, where no device's is given."""

CALIBRATION_BYTES = 8 * 2**20
"""Largest all-reduce the cost model times to measure the link's bandwidth (once, at the end of warm-up)."""


CALIBRATION_REPEATS = 5
"""All-reduces timed per size to measure the link (see `link_from_samples`)."""


LATENCY_REPEATS = 10
"""One-element all-reduces timed for the round trip (see `measure_latency`)."""


def _timed_all_reduce(
    buffer: torch.Tensor, group: dist.ProcessGroup, timeout_s: float, what: str,
    second_steps: SecondSteps | None = None, clock: HostSeam = HOST,
) -> tuple[float, float]:
    """Time of one all-reduce of ``buffer`` (in two steps with ``second_steps``), and the CPU time
    of this process (every thread) per second of it. Collective.

    Timed by ``clock``: on a GPU, events on the current stream around the collective and its
    wait (a host timestamp there would count the host's polling of an NCCL wait: in steps of
    milliseconds); the host's wall time on the CPU."""
    start, cpu_start = clock.stamp(), time.process_time()
    if second_steps is None:
        wait_or_raise(dist.all_reduce(buffer, group=group, async_op=True), timeout_s, what)
    else:
        TwoStepAllReduce(buffer, group, second_steps, what).wait(timeout_s)
    wall = clock.seconds_between(start, clock.stamp())
    return wall, (time.process_time() - cpu_start) / max(wall, 1e-9)


def measure_latency(
    group: dist.ProcessGroup, device: torch.device, timeout_s: float, repeats: int = LATENCY_REPEATS,
    clock: HostSeam = HOST,
) -> float:
    """The quickest of ``repeats`` one-element all-reduces on ``device`` (collective: every rank calls it).

    The quickest, not the median: they run back to back within a millisecond or
    two, so one slow spell of either host (a descheduled thread) covers most of
    them, and noise only ever adds time. The round trip is the floor of the fixed
    cost per collective (`measure_link`), so a median caught in such a spell made
    the cost model price every collective 5 to 35 times too high, in 5% of
    calibrations (docs/records/2026-11-24-link-calibration.md).
    """
    buffer, what = torch.zeros(1, device=device), "the latency measurement before agreeing on a plan"
    return min(_timed_all_reduce(buffer, group, timeout_s, what, clock=clock)[0] for _ in range(repeats))


def measure_link(
    group: dist.ProcessGroup, device: torch.device, nbytes: int, latency_s: float, timeout_s: float,
    clock: HostSeam = HOST,
) -> tuple[LinkModel, float]:
    """An all-reduce's cost as ``a + n / b`` at two sizes (``nbytes``, capped at
    `CALIBRATION_BYTES`, and an eighth of it), measured idle. Collective.

    ``a`` is the fixed cost of one collective at the sizes partitions have (the
    host's work and the link's latency), often well above a one-element round
    trip, and never taken below ``latency_s``, that round trip. Also returns the
    CPU time this process spends per second of the larger all-reduce (see
    `Timeline.transport_cpu_share`), and the collectives the transport runs at once
    (`commsched.profiling.link.collectives_in_flight`: gloo two, on gradients in host memory).
    The sizes take turns, after one untimed
    all-reduce each (the first of a size sets up the transport's buffers), so
    that a slow spell of the host slows both alike; see `link_from_samples`.
    """
    large = max(64, min(nbytes, CALIBRATION_BYTES)) // 4 * 4
    sizes = (large // 8 // 4 * 4, large)
    # The smaller all-reduce runs on the start of the larger one's buffer: one buffer, not two, is
    # what the calibration adds to the process for a moment.
    large_buffer = torch.zeros(large // 4, device=device)
    buffers = [large_buffer[:size // 4] for size in sizes]
    what = "the link measurement before choosing the partitioning"
    for buffer in buffers:
        _timed_all_reduce(buffer, group, timeout_s, what, clock=clock)
    samples = [[_timed_all_reduce(buffer, group, timeout_s, what, clock=clock) for buffer in buffers]
               for _ in range(CALIBRATION_REPEATS)]
    link, cpu_share = link_from_samples(sizes, samples, latency_s)
    return dataclasses.replace(link, in_flight=collectives_in_flight(group, device)), cpu_share


def link_from_samples(
    sizes: Sequence[int], samples: Sequence[Sequence[tuple[float, float]]], latency_s: float
) -> tuple[LinkModel, float]:
    """The line (`fit_link`) through each size's median time, its fixed cost never below
    ``latency_s``, and the median CPU share of the largest size.

    ``samples`` holds one row per repeat: per size, (wall seconds, CPU share).
    The fixed cost is the line extrapolated to zero bytes, so an error in one
    size's time moves it several times over, and one calibration decides the
    partitioning for the whole run: a fixed cost of 2.4 ms per collective, where
    other clusters of the same cell gave 0.2 to 0.4, made the cost model choose
    partitions four times larger (docs/records/2026-11-24-link-calibration.md).
    Medians of `CALIBRATION_REPEATS`, the sizes taking turns, keep a slow spell
    of two samples out of the fit.
    """
    medians = [statistics.median(wall for wall, _ in column) for column in zip(*samples)]
    fixed_s, bytes_per_s = fit_link(sizes, medians, latency_s)
    largest = max(range(len(sizes)), key=lambda i: sizes[i])
    cpu_share = statistics.median(row[largest][1] for row in samples)
    return LinkModel(latency_s=fixed_s, bytes_per_s=bytes_per_s), min(1.0, cpu_share)


TWO_STEP_SHARE = 0.9
"""The first bucket goes in two steps only where they took at most this share of the ring's time:
a decision taken on a few samples must not flip between runs on noise alone."""


@dataclass(frozen=True)
class TwoStepTiming:
    """The first bucket's all-reduce timed both ways behind a bulk all-reduce (medians, rank 0's):
    see `time_both_ways`."""

    nbytes: int
    behind_nbytes: int
    ring_s: float
    two_step_s: float

    @property
    def pays(self) -> bool:
        """Whether two steps are clearly faster (`TWO_STEP_SHARE`)."""
        return self.two_step_s <= TWO_STEP_SHARE * self.ring_s

    def describe(self) -> str:
        return (f"at {self.nbytes / 2**20:.3g} MiB behind an all-reduce of {self.behind_nbytes / 2**20:.3g} MiB, "
                f"two all-to-alls took {self.two_step_s * 1e3:.1f} ms and gloo's ring {self.ring_s * 1e3:.1f} ms")


def time_both_ways(group: dist.ProcessGroup, device: torch.device, nbytes: int, behind_nbytes: int,
                   second_steps: SecondSteps, timeout_s: float) -> TwoStepTiming:
    """An all-reduce of ``nbytes`` issued right behind one of ``behind_nbytes`` still on the wire,
    by the ring and in two steps, in turn, `CALIBRATION_REPEATS` times each after one untimed
    each: rank 0's medians of the time to its completion, the same on every rank (the two
    ways' collectives differ, so every rank must choose alike). Collective.

    [Note: timing the first bucket behind the others] The first bucket goes at the end of
    backward, behind the reductions of the other buckets still in flight, and that is where
    its time shows. Timed alone on an idle link, two steps are no faster than the ring, yet
    in training the first bucket in two steps made iterations 9% faster
    (docs/records/2026-11-28-two-step-all-reduce.md): the ring's messages queue behind the
    bulk's on the same connections, while the second steps go on a group of their own. So it
    is timed behind a bulk all-reduce, as in training.
    """
    first = torch.zeros(max(1, nbytes // 4), device=device)
    behind = torch.zeros(max(1, behind_nbytes // 4), device=device)
    what = "the timing of the first bucket's all-reduce, by the ring and in two steps"

    def timed(way: SecondSteps | None) -> float:
        bulk = dist.all_reduce(behind, group=group, async_op=True)
        seconds = _timed_all_reduce(first, group, timeout_s, what, way)[0]
        wait_or_raise(bulk, timeout_s, what)
        return seconds

    ways = (None, second_steps)
    for way in ways:
        timed(way)
    samples = [[timed(way) for way in ways] for _ in range(CALIBRATION_REPEATS)]
    medians = torch.tensor([statistics.median(column) for column in zip(*samples)], dtype=torch.float64)
    wait_or_raise(dist.broadcast(medians, group=group, group_src=0, async_op=True), timeout_s,
                  "the broadcast of rank 0's timing of the first bucket's all-reduce")
    return TwoStepTiming(first.numel() * 4, behind.numel() * 4, float(medians[0]), float(medians[1]))


@dataclass(frozen=True)
class Calibration:
    """The link, measured idle once per model: see `calibrate`."""

    latency_s: float
    """A one-element all-reduce's time, as this rank measured it."""
    link: LinkModel | None = None
    """An all-reduce's cost by size (None where the cost model does not run)."""
    transport_cpu_share: float = 0.0
    """See `Timeline.transport_cpu_share`."""
    two_step: TwoStepTiming | None = None
    """The first bucket's all-reduce timed both ways, where the transport may take two steps."""


def calibrate(layout: GradLayout, group: dist.ProcessGroup, timeout_s: float, with_link: bool,
              second_steps: SecondSteps | None = None, first_bucket_bytes: int = 0,
              clock: HostSeam = HOST) -> Calibration:
    """Time the link on ``group`` with tensors on the gradients' device. Collective.

    Runs where memory is lowest, at the end of warm-up's last profiled backward
    pass: every reduction is complete and the activations are freed. Its
    all-reduces of up to `CALIBRATION_BYTES` would otherwise add to the peak
    of a backward pass, with every activation alive.

    With ``second_steps`` (see [Note: an all-reduce in two steps] in
    `commsched.comm.two_step`), the first bucket is also all-reduced both ways,
    behind an all-reduce of the largest other bucket (`time_both_ways`), at its
    size as configured (``first_bucket_bytes``; in warm-up's layout, cut before
    the forward order is known, it may be smaller), at most every gradient's.
    """
    device = layout.buckets[0].flat.device
    latency_s = measure_latency(group, device, timeout_s, clock=clock)
    two_step = None
    if second_steps is not None:
        total = sum(b.wire_nbytes for b in layout.buckets)
        first = min(max(layout.buckets[layout.flags_bucket].wire_nbytes, first_bucket_bytes), total)
        others = [b.wire_nbytes for i, b in enumerate(layout.buckets) if i != layout.flags_bucket]
        behind = min(max(others, default=first), CALIBRATION_BYTES)
        two_step = time_both_ways(group, device, first, behind, second_steps, timeout_s)
    if not with_link:
        return Calibration(latency_s, two_step=two_step)
    link, cpu_share = measure_link(group, device, sum(b.nbytes for b in layout.buckets), latency_s, timeout_s,
                                   clock=clock)
    return Calibration(latency_s, link, cpu_share, two_step)
