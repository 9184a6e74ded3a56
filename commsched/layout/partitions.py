"""Partitions and the plan: the units on the wire, and the one order every rank issues them in.

Pure logic, no process group: testable with a recording fake launcher.

[Note: the agreed order] Collectives are matched by issue order, so every rank
must issue partitions in the same sequence whatever its timing. A local
priority queue would decide by timing; instead all ranks follow one *plan*, a
fixed sequence of partition ids. Each rank issues the next partition of the
plan as soon as it is ready locally and fits the credit window, and never skips
ahead. The plan is computed by rank 0 by simulating priority scheduling under
credit on its own measured timeline (`commsched.planning.schedule`), and
published once, so the per-partition cost is nothing but the issue itself.
Each pass's `commsched.engine.dispatch.PlanExecutor` follows it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Partition:
    """A contiguous slice ``[start, end)`` of one bucket's flat buffer."""

    pid: int
    bucket: int
    start: int
    end: int
    nbytes: int
    priority: int
    """Lower is more urgent: the forward position of the bucket's first parameter."""


def make_partitions(
    bucket_numels: Sequence[int],
    element_sizes: Sequence[int],
    bucket_priorities: Sequence[int],
    partition_bytes: int | None,
) -> list[Partition]:
    """Cut every bucket into slices of about ``partition_bytes`` (whole if None).

    The number of slices is the bucket's size over ``partition_bytes``, rounded to
    the nearest (at least one), and slices are as equal as possible: no slice is
    larger than 1.5 times ``partition_bytes`` (or one element), and a bucket just
    over the size, as size-based buckets usually are, is not cut into two halves
    that would cost two collectives instead of one.
    """
    partitions: list[Partition] = []
    for bucket, (numel, size, priority) in enumerate(
        zip(bucket_numels, element_sizes, bucket_priorities, strict=True)
    ):
        if partition_bytes is None:
            pieces = 1
        else:
            target_elements = max(1, partition_bytes // size)
            pieces = min(numel, max(1, int(numel / target_elements + 0.5)))
        for piece in range(pieces):
            start, end = numel * piece // pieces, numel * (piece + 1) // pieces
            partitions.append(Partition(len(partitions), bucket, start, end, (end - start) * size, priority))
    return partitions


def fifo_plan(partitions: Sequence[Partition]) -> list[int]:
    """Buckets in the order they become ready, partitions in order: torch DDP's order."""
    return [p.pid for p in sorted(partitions, key=lambda p: (p.bucket, p.start))]


@dataclass(frozen=True, eq=False)
class Plan:
    """The agreed issue order of every partition, and the credit window it runs under."""

    partitions: tuple[Partition, ...]
    order: tuple[int, ...]
    """Partition ids in issue order: every rank issues exactly this sequence."""
    credit_bytes: int | None
    agreed: bool = False
    """False: torch DDP's order (`fifo_plan`); True: rank 0's plan, agreed by every rank."""
    by_readiness: bool = False
    """Rank 0's plan is the order its buckets became ready, not urgency: forward overlap is off
    ([Note: a plan without urgency] in `commsched.planning.schedule`)."""

    def __post_init__(self) -> None:
        if sorted(self.order) != list(range(len(self.partitions))):
            raise ValueError("a plan must name every partition exactly once")

    @property
    def num_buckets(self) -> int:
        return 1 + max((p.bucket for p in self.partitions), default=-1)

