"""Rank 0 measures its timeline and the link, plans the order, and publishes it.

See [Note: the agreed order] in `commsched.scheduler`. Everything here runs at
one agreed point (the start of a given backward pass), on every rank, so the
calibration collectives and the plan broadcast line up.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from commsched.errors import wait_or_raise
from commsched.events import Observer
from commsched.lifecycle import WARMUP_ITERATIONS
from commsched.scheduler import LinkModel, Partition, Plan, robust_plan, simulate_schedule
from commsched.transport.base import Handle

LINK_SAFETY_FACTOR = 0.8
"""Plan for a link this much slower than measured: a partition planned too late costs
a little idle link time, one planned too early delays the next forward pass."""


class ReadyTimeProfile(Observer):
    """One rank's timeline of the warm-up backward passes (run without overlap).

    An observer of the core's events, recording iterations 1 to
    ``WARMUP_ITERATIONS - 1`` (the first is slow): when each bucket became ready
    (relative to the start of the backward pass), and how long the link took
    from the first partition issued to the last one completed. The latter,
    under the real load of training (computation competing with communication
    for the same cores), is a better, and more cautious, estimate of the link
    than an idle calibration.
    """

    def __init__(self, num_buckets: int):
        self._num_buckets = num_buckets
        self._ready: list[list[float]] = []
        self._transfers: list[tuple[int, float]] = []
        self._recording = False
        self._current: list[float] = []
        self._start = self._first_launch = 0.0
        self._bytes = 0

    def iteration_started(self, iteration: int) -> None:
        self._recording = 0 < iteration < WARMUP_ITERATIONS
        if self._recording:
            self._start = time.perf_counter()
            self._current = [0.0] * self._num_buckets
            self._first_launch, self._bytes = 0.0, 0

    def bucket_ready(self, bucket: int) -> None:
        if self._recording:
            self._current[bucket] = time.perf_counter() - self._start

    def partition_issued(self, partition: Partition, handle: Handle) -> None:
        if self._recording:
            if not self._bytes:
                self._first_launch = time.perf_counter()
            self._bytes += partition.nbytes

    def backward_finished(self) -> None:
        """During warm-up, every reduction of the iteration has completed by now."""
        if not self._recording:
            return
        self._recording = False
        self._ready.append(self._current)
        if self._bytes:
            self._transfers.append((self._bytes, time.perf_counter() - self._first_launch))

    def median_ready_s(self) -> list[float]:
        if not self._ready:
            return [0.0] * self._num_buckets
        return [statistics.median(column) for column in zip(*self._ready)]

    def loaded_bytes_per_s(self) -> float | None:
        """Bytes over first-issue-to-last-completion time, median over iterations."""
        if not self._transfers:
            return None
        return statistics.median(nbytes / max(seconds, 1e-9) for nbytes, seconds in self._transfers)


def measure_latency(group: dist.ProcessGroup, timeout_s: float, repeats: int = 5) -> float:
    """Median time of a one-element all-reduce (collective: every rank calls it)."""
    buffer = torch.zeros(1)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        wait_or_raise(dist.all_reduce(buffer, group=group, async_op=True), timeout_s,
                      "the latency measurement before agreeing on a plan")
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def plan_on_rank0(
    partitions: Sequence[Partition],
    profile: ReadyTimeProfile,
    credit_bytes: int | None,
    group: dist.ProcessGroup,
    timeout_s: float,
) -> Plan:
    """Simulate priority scheduling on rank 0's timeline; broadcast rank 0's plan.

    Collective: every rank calls it at the same point; a peer that does not
    raises `CommunicationTimeout` after ``timeout_s``. The link is modelled by
    the measured latency and the bandwidth seen while training; if the link is
    faster than that, non-urgent partitions merely go a little later, never
    ahead of urgent ones.
    """
    latency = measure_latency(group, timeout_s)
    bytes_per_s = (profile.loaded_bytes_per_s() or 1e12) * LINK_SAFETY_FACTOR
    link = LinkModel(latency_s=latency, bytes_per_s=bytes_per_s)
    ready = profile.median_ready_s()
    schedule = simulate_schedule(partitions, ready, link, credit_bytes, by_priority=True)
    plan = torch.tensor(robust_plan(partitions, schedule, max(ready, default=0.0)), dtype=torch.int64)
    if dist.get_world_size(group) > 1:
        work = dist.broadcast(plan, group=group, group_src=0, async_op=True)
        wait_or_raise(work, timeout_s, "the broadcast of rank 0's plan")
    return Plan(tuple(partitions), tuple(plan.tolist()), credit_bytes, agreed=True)
