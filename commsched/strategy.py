"""`Strategy`: every knob of commsched in one validated object."""

from __future__ import annotations

import math
import os
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

    priority: bool = True
    """Send what the next forward pass needs first: partitions are issued by the
    position of their parameters in the forward execution order recorded in the
    first iteration (nearest the input most urgent), instead of in the order
    gradients become ready."""

    partition_mb: float | None = 1.0
    """The unit on the wire, in MiB: buckets are cut into zero-copy slices of about
    this size (at most 1.5 times it) so an urgent partition can overtake a large
    bucket between two of its slices. ``None`` sends each bucket whole."""

    credit_mb: float | None = 4.0
    """Most bytes in flight during the backward pass, in MiB: a partition is
    issued only if it fits (one larger than the window goes alone), which keeps
    the queue short enough for urgent partitions to overtake. ``None`` issues
    everything as soon as the agreed order allows."""

    overlap_forward: bool = True
    """Let the next forward pass start before all reductions are done:
    ``optimizer.step()`` returns at once, each bucket is updated when its
    reduction completes, and each module waits only for its own parameters.
    Switched off automatically when gradients are modified between
    ``backward()`` and ``step()`` (``clip_grad_norm_``, AMP unscaling), or when
    the optimizer has no per-bucket update (only SGD, Adam and AdamW do)."""

    fuse_optimizer: bool = True
    """Update SGD, Adam and AdamW parameters bucket by bucket with torch's fused
    kernels (``fused=True``) instead of the optimizer's own per-tensor loop."""

    trace_dir: str | None = None
    """Write a timeline per rank (``rank<N>.json``, Chrome trace format) into this
    directory: forward and backward per module, per partition its queue and wire
    time, per bucket its update, and every wait on communication. Read it with
    ``commsched trace-report DIR`` or Perfetto. Off (None) it costs nothing."""

    timeout_s: float = 300.0
    """Longest wait, in seconds, for one gradient reduction (or for one of the few
    collectives that agree on the order and the plan). A peer that died or
    stopped participating gives a ``CommunicationTimeout`` naming what was
    waited for instead of a hang."""

    backend: str = "allreduce"
    """``"allreduce"``: every rank trains and gradients are averaged with
    all-reduce. ``"ps"``: the last ``num_servers`` ranks of the world are
    parameter servers; workers push gradient blocks to them, the servers apply
    the optimizer and workers pull the new values (see docs/parameter_server.md)."""

    num_servers: int = 1
    """With ``backend="ps"``: how many ranks serve (the last ones of the world)."""

    ps_mode: str = "sync"
    """With ``backend="ps"``: ``"sync"`` waits for every worker's gradient of a
    block, averages and updates once (the same parameters as single-process
    training); ``"async"`` applies each worker's gradient (divided by the number
    of workers) as it arrives, and workers pull whatever is newest."""

    ps_max_staleness: int | None = None
    """With ``ps_mode="async"``: how many iterations a worker may run ahead of the
    slowest worker still training. A worker further ahead gets its new values
    only when the others catch up, so its next forward pass waits (stale
    synchronous parallel). None: unbounded, the staleness is only reported."""

    def __post_init__(self) -> None:
        _check_positive_finite("bucket_cap_mb", self.bucket_cap_mb)
        _check_positive_finite("first_bucket_mb", self.first_bucket_mb)
        _check_positive_finite("timeout_s", self.timeout_s)
        _check_positive_finite("partition_mb", self.partition_mb, optional=True)
        _check_positive_finite("credit_mb", self.credit_mb, optional=True)
        if self.trace_dir is not None and not isinstance(self.trace_dir, (str, os.PathLike)):
            raise ValueError(
                f"Strategy.trace_dir must be a directory path or None, got {self.trace_dir!r}"
            )
        for name in ("broadcast_buffers", "priority", "overlap_forward", "fuse_optimizer"):
            _check_bool(name, getattr(self, name))
        _check_choice("backend", self.backend, ("allreduce", "ps"))
        _check_choice("ps_mode", self.ps_mode, ("sync", "async"))
        if isinstance(self.num_servers, bool) or not isinstance(self.num_servers, int) or self.num_servers < 1:
            raise ValueError(f"Strategy.num_servers must be an integer >= 1, got {self.num_servers!r}")
        if self.backend != "ps" and (self.num_servers != 1 or self.ps_mode != "sync"):
            raise ValueError(
                f"Strategy.num_servers and Strategy.ps_mode apply to backend='ps' only, got "
                f"backend={self.backend!r} with num_servers={self.num_servers!r}, "
                f"ps_mode={self.ps_mode!r}; set backend='ps' or leave them at their defaults"
            )
        if self.ps_max_staleness is not None:
            if (isinstance(self.ps_max_staleness, bool) or not isinstance(self.ps_max_staleness, int)
                    or self.ps_max_staleness < 0):
                raise ValueError(
                    f"Strategy.ps_max_staleness must be None or an integer >= 0, got {self.ps_max_staleness!r}"
                )
            if self.backend != "ps" or self.ps_mode != "async":
                raise ValueError(
                    f"Strategy.ps_max_staleness applies to backend='ps' with ps_mode='async' only, got "
                    f"backend={self.backend!r}, ps_mode={self.ps_mode!r}; set both or leave "
                    "ps_max_staleness at None"
                )

    @property
    def parameter_server(self) -> bool:
        return self.backend == "ps"

    @property
    def bucket_size_limits_bytes(self) -> list[int]:
        """Bucket size limits in the form `compute_bucket_assignment_by_size` takes.

        With partitions, a bucket is also the unit of update and of gating, so it
        is capped at the partition size: small tensors still travel together,
        large ones get a bucket of their own and are cut, and an urgent layer is
        never held back by a large, late one sharing its bucket.
        """
        cap_mb = self.bucket_cap_mb if self.partition_mb is None else min(self.bucket_cap_mb, self.partition_mb)
        first_mb = min(self.first_bucket_mb, cap_mb)
        return [int(first_mb * MIB), int(cap_mb * MIB)]

    @property
    def partition_bytes(self) -> int | None:
        return None if self.partition_mb is None else max(1, int(self.partition_mb * MIB))

    @property
    def ps_block_bytes(self) -> int:
        """Target size of a parameter-server block: a partition, or a whole bucket without partitions."""
        return self.partition_bytes or int(self.bucket_cap_mb * MIB)

    @property
    def credit_bytes(self) -> int | None:
        return None if self.credit_mb is None else max(1, int(self.credit_mb * MIB))

    def describe(self) -> str:
        """One line with every field, for logs."""
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))


def _check_positive_finite(name: str, value: object, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "a number or None" if optional else "a number"
        raise ValueError(f"Strategy.{name} must be {kind}, got {value!r} ({type(value).__name__})")
    if not (math.isfinite(value) and value > 0):
        allowed = "None or finite and greater than 0" if optional else "finite and greater than 0"
        raise ValueError(f"Strategy.{name} must be {allowed}, got {value!r}")


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"Strategy.{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(
            f"Strategy.{name} must be True or False, got {value!r} ({type(value).__name__})"
        )
