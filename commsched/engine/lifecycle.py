"""Where a prepared model stands: one `Lifecycle` value instead of a set of flags."""

from __future__ import annotations

import enum

WARMUP_ITERATIONS = 3
"""Synchronised iterations run without forward overlap while gradient changes are
watched; all but the first (slow) one are profiled, and the plan is made when they end."""


class Lifecycle(enum.Enum):
    RECORDING = "recording"
    """No layout yet: the first forward pass records the order parameters are used in."""
    WARMUP = "warm-up"
    """The first `WARMUP_ITERATIONS` synchronised iterations: no forward overlap;
    gradient changes between ``backward()`` and ``step()`` are watched; with
    priority, iterations 1 and 2 are profiled for the plan."""
    OVERLAPPING = "overlapping"
    """After warm-up, with forward overlap: ``step()`` returns at once and each
    module waits at its gate for its own buckets."""
    SYNCHRONOUS = "synchronous"
    """After warm-up, without forward overlap (the reason is reported beside it):
    the end of backward waits for every reduction, ``step()`` updates."""
    RELEASED = "released"
    """`commsched.release` was called: hooks are gone, the model trains locally."""

    @classmethod
    def after_warmup(cls, overlap_off_reason: str | None) -> Lifecycle:
        return cls.SYNCHRONOUS if overlap_off_reason else cls.OVERLAPPING


class Phase(enum.Enum):
    """Where the autograd engine is, as far as gradient hooks tell."""

    IDLE = "idle"
    BACKWARD = "backward"
    """A synchronised backward pass is producing gradients and issuing partitions."""
    ACCUMULATING = "accumulating"
    """A backward pass under ``no_sync()``: gradients accumulate locally."""
