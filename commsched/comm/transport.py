"""What a transport is: it puts one partition of a bucket on the wire and hands back a `Handle`.

The reducer decides *which* partition goes *when*; a transport decides what
that means on the wire (an all-reduce among the replicas; a push to a
parameter server and the pull of its answer; a reduce-scatter; later a
codec).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from commsched.comm.two_step import SecondSteps
from commsched.errors import CommunicationTimeout
from commsched.layout.buckets import Bucket, BucketSet
from commsched.layout.partitions import Partition

if TYPE_CHECKING:
    from commsched.comm.powersgd import PowerSGDCompressor


class Handle(Protocol):
    """An operation in flight. It keeps its buffers alive until waited on."""

    def wait(self, timeout_s: float) -> None:
        """Block until done; raise `CommunicationTimeout` after ``timeout_s``."""

    def order(self) -> bool:
        """Make the current stream wait for the operation without blocking the host, and queue
        what follows it there; False where the backend cannot (the host then waits). Called only
        for tensors on a device with streams (see [Note: stream-ordered waits] in commsched/device.py)."""

    def is_completed(self) -> bool:
        """True once the operation has finished (without blocking)."""

    def on_complete(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on any thread) once the operation has finished, or, where the
        transport's ``completion_callbacks`` is False, once it was enqueued."""


class CompletedHandle:
    """A handle for work that needed no communication (a single replica)."""

    def wait(self, timeout_s: float) -> None:
        return None

    def order(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def on_complete(self, callback: Callable[[], None]) -> None:
        callback()


COMPLETED = CompletedHandle()


@dataclass(frozen=True)
class TransportStatus:
    """What a transport is, and where it sends the partitions."""

    description: str
    """One line for logs and `commsched.status`."""
    placement: str | None = None
    """Where each partition goes, for the trace (None: nothing beyond the description)."""
    server_bytes: tuple[int, ...] = ()
    """Bytes of partitions each server holds (empty without servers)."""
    two_step_max_bytes: int | None = None
    """Partitions of at most this many bytes go in two all-to-alls (None: two steps never apply)."""


class Scattering(Protocol):
    """A transport's reduce-scatter of gradient buckets (an optional capability: `Transport.scatter`)."""

    chunk_padding: int
    """Every bucket but the flags bucket is padded to a multiple of this many elements, from the
    first layout on, so that scattering needs no layout of its own."""

    active: bool
    """True once buckets are reduce-scattered: each rank then holds the average of its own chunk
    of them only (`averaged_range`)."""

    def start(self) -> None:
        """From the next layout on, reduce-scatter the buckets (every rank alike)."""

    def averaged_range(self, bucket: Bucket) -> tuple[int, int]:
        """The elements of ``bucket``'s gradients that hold the average on this rank once reduced."""


class TwoStepTiming(Protocol):
    """Where the first bucket may go in two all-to-alls if they time faster (`Transport.two_steps`)."""

    second_steps: SecondSteps
    """Where the second steps are issued, for the timing."""

    def use(self, max_bytes: int, why: str) -> None:
        """From now on, all-reduce the first bucket's partitions of at most ``max_bytes`` in two
        steps (0: none); ``why`` says what the timing found. The same on every rank."""


class Transport(Protocol):
    """Moves partitions of gradient buckets; built by `commsched.prepare` for its backend."""

    world_size: int
    """The number of data-parallel replicas (ranks that compute gradients)."""

    is_local: bool
    """True when nothing goes on the wire (a single replica)."""

    completion_callbacks: bool
    """True when a handle's ``on_complete`` runs once the operation is done (gloo, parameter
    servers); False where it runs when the operation is enqueued (NCCL), so that only
    ``is_completed()`` tells (credit then returns at the dispatch points: the gradient hooks)."""

    join_refusal: str | None
    """Why a rank out of batches cannot shadow the others' iterations under torch's ``Join``
    (see [Note: uneven inputs] in `commsched.engine.join`), or None where it can."""

    sums_usage_flags: bool
    """True when a partition arrives summed over the replicas, so per-parameter
    "has a gradient" flags can ride in the tail of the flags bucket
    (see [Note: unused parameters] in `commsched.engine.backward_pass`)."""

    scatter: Scattering | None
    """Where buckets may be reduce-scattered (``AllReduce(reduce_scatter=True)`` among replicas):
    how; None where they never are (see [Note: reduce-scattered buckets] in
    `commsched.comm.reduce_scatter`)."""

    two_steps: TwoStepTiming | None
    """Where the first bucket may be all-reduced in two all-to-alls if they time faster at the
    end of warm-up (see [Note: an all-reduce in two steps] in `commsched.comm.two_step`)."""

    compression: PowerSGDCompressor | None
    """Where buckets go compressed (`commsched.Strategy.compression` among replicas): the
    compressor's state; None where they never are (see [Note: PowerSGD under the schedule] in
    `commsched.comm.powersgd`)."""

    def attach(self, bucket_set: BucketSet, partition_bytes: int | None) -> list[Partition]:
        """The buckets exist: cut them into partitions (the units on the wire) of about
        ``partition_bytes`` (None: whole buckets), or into the transport's own units,
        and get ready."""

    def bucket_ready(self, bucket: Bucket) -> None:
        """Every gradient of ``bucket`` is final for this iteration: prepare it for the wire."""

    def begin_iteration(self, iteration: int, new_plan: Sequence[int] | None) -> None:
        """A synchronised backward pass starts (``new_plan``: the issue order just agreed, if it changed)."""

    def launch(self, partition: Partition, bucket: Bucket, has_grad: Sequence[bool]) -> Handle:
        """Start communicating ``partition`` of ``bucket``; return at once.

        ``has_grad[slot]``: whether this rank holds a gradient for that parameter.
        """

    def explain_failure(self, error: CommunicationTimeout) -> None:
        """A collective among the replicas failed: raise a more precise error if one is known."""

    def describe(self) -> TransportStatus:
        """What this transport is and, once attached, where the partitions go."""

    def finish(self) -> None:
        """No more iterations: release peers waiting for this rank (idempotent)."""

    def forget_process_groups(self) -> None:
        """At exit, after `finish`: drop references to process groups (see [Note: process groups at exit])."""

