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

from commsched.scheduler import LinkModel, Partition, simulate_schedule


class ReadyTimeProfile:
    """When each bucket became ready, relative to the first gradient, per iteration."""

    def __init__(self, num_buckets: int):
        self._num_buckets = num_buckets
        self._iterations: list[list[float]] = []
        self._current: list[float] = []
        self._start = 0.0

    def begin(self) -> None:
        self._start = time.perf_counter()
        self._current = [0.0] * self._num_buckets

    def bucket_ready(self, bucket: int) -> None:
        self._current[bucket] = time.perf_counter() - self._start

    def end(self) -> None:
        self._iterations.append(self._current)

    def median(self) -> list[float]:
        if not self._iterations:
            return [0.0] * self._num_buckets
        return [statistics.median(column) for column in zip(*self._iterations)]


def measure_link(group: dist.ProcessGroup, nbytes: int, repeats: int = 3) -> LinkModel:
    """Time all-reduces of one element and of ``nbytes`` (collective: every rank calls it)."""

    def timed(numel: int) -> float:
        buffer = torch.zeros(numel)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            dist.all_reduce(buffer, group=group)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    latency = timed(1)
    numel = max(nbytes // 4, 1)
    transfer = max(timed(numel) - latency, 1e-9)
    return LinkModel(latency_s=latency, bytes_per_s=numel * 4 / transfer)


def plan_on_rank0(
    partitions: Sequence[Partition],
    profile: ReadyTimeProfile,
    credit_bytes: int | None,
    group: dist.ProcessGroup,
) -> list[int]:
    """Calibrate the link, simulate on rank 0's timeline, broadcast rank 0's plan."""
    largest = max((p.nbytes for p in partitions), default=4)
    link = measure_link(group, nbytes=max(largest, 256 * 1024))
    order = simulate_schedule(partitions, profile.median(), link, credit_bytes, by_priority=True).order
    plan = torch.tensor(order, dtype=torch.int64)
    if dist.get_world_size(group) > 1:
        dist.broadcast(plan, group=group, group_src=0)
    return plan.tolist()
