"""`Strategy`: every knob of commsched in one validated object."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

MIB = 1024 * 1024


@dataclass(frozen=True, kw_only=True, slots=True)
class Strategy:
    """How commsched buckets and communicates gradients.

    Built once and validated at construction: a bad value raises ``ValueError``
    naming the field, the value received and the allowed range.
    """

    bucket_cap_mb: float = 25.0
    """Size limit of a gradient bucket, in MiB (as torch DDP's ``bucket_cap_mb``).
    Larger buckets mean fewer, larger all-reduces; smaller ones start
    communication earlier in the backward pass."""

    first_bucket_mb: float = 1.0
    """Size limit of the first bucket, in MiB: the gradients produced first in the
    backward pass go out in a small bucket so communication starts early."""

    broadcast_buffers: bool = True
    """Broadcast the module's buffers (e.g. BatchNorm running statistics) from
    rank 0 at the start of every forward pass that records gradients, as torch
    DDP does. Turn off when buffers are kept in sync by other means."""

    timeout_s: float = 300.0
    """Longest wait, in seconds, for one gradient reduction. A peer that died or
    stopped participating gives a ``CommunicationTimeout`` naming the bucket
    instead of a hang."""

    def __post_init__(self) -> None:
        _check_positive_finite("bucket_cap_mb", self.bucket_cap_mb)
        _check_positive_finite("first_bucket_mb", self.first_bucket_mb)
        _check_positive_finite("timeout_s", self.timeout_s)
        _check_bool("broadcast_buffers", self.broadcast_buffers)

    @property
    def bucket_size_limits_bytes(self) -> list[int]:
        """Bucket size limits in the form `compute_bucket_assignment_by_size` takes."""
        return [int(self.first_bucket_mb * MIB), int(self.bucket_cap_mb * MIB)]

    def describe(self) -> str:
        """One line with every field, for logs."""
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))


def _check_positive_finite(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"Strategy.{name} must be a number, got {value!r} ({type(value).__name__})"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"Strategy.{name} must be finite and greater than 0, got {value!r}"
        )


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(
            f"Strategy.{name} must be True or False, got {value!r} ({type(value).__name__})"
        )
