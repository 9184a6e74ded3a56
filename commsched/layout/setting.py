"""`LayoutSetting`: the knobs a run may change while it trains, and what they become in bytes.

The buckets, partitions and plan depend on these fields of a `Strategy` and on
nothing else it holds; forward overlap decides whether updates wait at the
gates. A run starts with the configured ones; the cost model may change the
partitioning at the end of warm-up, and the auto-tuner any of them at its
switch points (see [Note: auto-tuning] in `commsched.tuning`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from commsched.strategy import Strategy, bucket_size_limits_bytes, size_bytes


@dataclass(frozen=True)
class LayoutSetting:
    """A `Strategy`'s layout fields and forward overlap."""

    partition_mb: float | None
    credit_mb: float | None
    bucket_cap_mb: float
    first_bucket_mb: float
    overlap_forward: bool
    gathers: bool = False
    """Sharded optimizer state: the updated parameters of each bucket are all-gathered, one
    bucket at a time (the cost model charges each its fixed cost)."""

    @classmethod
    def of(cls, strategy: Strategy) -> LayoutSetting:
        return cls(strategy.partition_mb, strategy.credit_mb, strategy.bucket_cap_mb, strategy.first_bucket_mb,
                   strategy.overlap_forward, strategy.shards_optimizer)

    def applied(self, strategy: Strategy) -> Strategy:
        """``strategy`` with this setting (validated by `Strategy` as any other)."""
        return dataclasses.replace(
            strategy, partition_mb=self.partition_mb, credit_mb=self.credit_mb, bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_mb=self.first_bucket_mb, overlap_forward=self.overlap_forward,
        )

    def with_partitioning(self, partition_mb: float | None, credit_mb: float | None) -> LayoutSetting:
        return dataclasses.replace(self, partition_mb=partition_mb, credit_mb=credit_mb)

    @property
    def partition_bytes(self) -> int | None:
        return size_bytes(self.partition_mb)

    @property
    def credit_bytes(self) -> int | None:
        return size_bytes(self.credit_mb)

    def bucket_size_limits_bytes(self, block_mb: float | None = None) -> list[int]:
        """See `Strategy.bucket_size_limits_bytes` (``block_mb``: a parameter server's largest block)."""
        return bucket_size_limits_bytes(self.bucket_cap_mb, self.first_bucket_mb, self.partition_mb, block_mb)

    def layout(self) -> tuple[object, ...]:
        """What the buckets, partitions and plan depend on: bucket limits, partition and credit bytes."""
        return tuple(self.bucket_size_limits_bytes()), self.partition_bytes, self.credit_bytes

    def behaviour(self) -> tuple[object, ...]:
        """What the run depends on: two settings with the same behaviour run identically
        (a bucket cap above the partition size, say, changes nothing)."""
        return (*self.layout(), self.overlap_forward)

    def describe(self) -> str:
        wire = "whole buckets" if self.partition_mb is None else f"partitions of {self.partition_mb:g} MiB"
        credit = "no credit window" if self.credit_mb is None else f"credit {self.credit_mb:g} MiB"
        return (f"{wire}, {credit}, buckets of {self.bucket_cap_mb:g} MiB (first {self.first_bucket_mb:g} MiB), "
                f"overlap {'on' if self.overlap_forward else 'off'}")

    def encode(self) -> list[float]:
        """Five floats for a broadcast; `decode` is exact (float64 carries every value)."""
        return [none_as(self.partition_mb), none_as(self.credit_mb), self.bucket_cap_mb, self.first_bucket_mb,
                1.0 if self.overlap_forward else 0.0]

    @classmethod
    def decode(cls, values: Sequence[float]) -> LayoutSetting:
        partition, credit, cap, first, overlap = (float(v) for v in values)
        return cls(as_none(partition), as_none(credit), cap, first, overlap > 0.5)


def none_as(value: float | None) -> float:
    """``value`` in a float broadcast, None as -1 (every size and time is positive)."""
    return -1.0 if value is None else float(value)


def as_none(value: float) -> float | None:
    return None if value < 0 else value
