"""The settings the auto-tuner may try, around a model's gradient bytes."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from commsched.layout.setting import LayoutSetting
from commsched.strategy import MAX_SIZE_MB, MIB, MIN_BUCKET_MB, MIN_PARTITION_MB

CREDIT_RATIOS = (1.0, 2.0, 4.0, 8.0, None)
"""The credit window as a multiple of the unit on the wire (None: unbounded)."""


# ------------------------------------------------------------------ the space
@dataclass(frozen=True)
class SearchSpace:
    """The settings the tuner may try: each dimension an ordered list of values.

    Sizes are powers of two spaced by four around the model's gradient bytes,
    with the starting setting's own values added, so the start is a point of the
    space. Ordered, so the optimiser learns "larger is better" from neighbours.
    """

    partition_mb: tuple[float | None, ...]
    """Ascending; None (whole buckets, the largest unit) last."""
    credit_ratio: tuple[float | None, ...]
    """The credit window in units on the wire (the partition, or the bucket cap for whole
    buckets); None (unbounded) last."""
    bucket_cap_mb: tuple[float, ...]
    first_bucket_mb: tuple[float, ...]
    overlap_forward: tuple[bool, ...]

    DIMENSIONS = ("partition_mb", "credit_ratio", "bucket_cap_mb", "first_bucket_mb", "overlap_forward")

    @classmethod
    def around(cls, gradient_bytes: int, start: LayoutSetting, overlap_allowed: bool) -> SearchSpace:
        """The space for a model of ``gradient_bytes`` gradient bytes, holding ``start``.

        ``overlap_allowed``: forward overlap may be switched on (the strategy asks
        for it and nothing blocked it during warm-up); otherwise it stays off.
        """
        total_mb = max(gradient_bytes / MIB, MIN_PARTITION_MB)
        partitions = _powers(total_mb / 512, total_mb / 2, MIN_PARTITION_MB)
        caps = _powers(total_mb / 64, total_mb, MIN_BUCKET_MB)
        firsts = _powers(total_mb / 256, total_mb / 4, MIN_BUCKET_MB)
        if start.gathers:  # [Note: a bucket's size bounds sharded state's memory] in commsched.update.sharded
            caps = {cap for cap in caps if cap <= start.bucket_cap_mb}
            firsts = {first for first in firsts if first <= start.bucket_cap_mb}
        partition_values: list[float | None] = sorted(set(partitions) | _present(start.partition_mb)) + [None]
        ratio = _credit_ratio(start)
        ratios: list[float | None] = sorted({r for r in CREDIT_RATIOS if r is not None} | _present(ratio)) + [None]
        overlap = (True, False) if overlap_allowed else (False,)
        return cls(
            tuple(partition_values), tuple(ratios),
            tuple(sorted(set(caps) | {start.bucket_cap_mb})), tuple(sorted(set(firsts) | {start.first_bucket_mb})),
            overlap,
        )

    def setting(self, indices: dict[str, int]) -> LayoutSetting:
        """The setting at ``indices`` (one per dimension)."""
        partition = self.partition_mb[indices["partition_mb"]]
        cap = self.bucket_cap_mb[indices["bucket_cap_mb"]]
        ratio = self.credit_ratio[indices["credit_ratio"]]
        unit = cap if partition is None else partition
        credit = None if ratio is None else min(MAX_SIZE_MB, max(MIN_PARTITION_MB, unit * ratio))
        return LayoutSetting(partition, credit, cap, self.first_bucket_mb[indices["first_bucket_mb"]],
                            self.overlap_forward[indices["overlap_forward"]])

    def indices(self, setting: LayoutSetting) -> dict[str, int]:
        """The indices of ``setting``, which must be a point of the space."""
        return {
            "partition_mb": self.partition_mb.index(setting.partition_mb),
            "credit_ratio": self.credit_ratio.index(_credit_ratio(setting)),
            "bucket_cap_mb": self.bucket_cap_mb.index(setting.bucket_cap_mb),
            "first_bucket_mb": self.first_bucket_mb.index(setting.first_bucket_mb),
            "overlap_forward": self.overlap_forward.index(setting.overlap_forward),
        }

    def sizes(self) -> dict[str, int]:
        return {name: len(getattr(self, name)) for name in self.DIMENSIONS}

    def grid(self) -> Iterator[LayoutSetting]:
        """Every point of the space (for an exhaustive comparison)."""
        sizes = self.sizes()
        total = math.prod(sizes.values())
        for flat in range(total):
            indices = {}
            for name in self.DIMENSIONS:
                flat, indices[name] = divmod(flat, sizes[name])
            yield self.setting(indices)


def _powers(low: float, high: float, floor: float) -> set[float]:
    """Powers of two from about ``low`` to ``high``, spaced by four, none below ``floor``."""
    exponent = round(math.log2(max(low, floor)))
    values = set()
    while True:
        value = max(floor, min(MAX_SIZE_MB, 2.0**exponent))
        values.add(value)
        if value >= high or value >= MAX_SIZE_MB:
            return values
        exponent += 2


def _present(value: float | None) -> set[float]:
    return set() if value is None else {value}


def _credit_ratio(setting: LayoutSetting) -> float | None:
    if setting.credit_mb is None:
        return None
    unit = setting.bucket_cap_mb if setting.partition_mb is None else setting.partition_mb
    return setting.credit_mb / unit
