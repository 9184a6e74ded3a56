"""All-reduce transport: each partition is averaged over the process group in place.

A failed reduction names the lost rank: see [Note: naming the lost rank] in
`commsched.comm.heartbeat`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from commsched.comm.heartbeat import Heartbeat
from commsched.comm.reduce_dtype import average_onto_wire, copy_back, wire_dtype
from commsched.comm.transport import COMPLETED, Handle, TransportStatus
from commsched.errors import CommunicationTimeout, wait_or_raise
from commsched.layout.buckets import Bucket, BucketSet
from commsched.layout.partitions import Partition, make_partitions

logger = logging.getLogger("commsched")


class _WorkHandle:
    """A torch.distributed ``Work`` whose failure or timeout becomes a clear error."""

    __slots__ = ("_work", "_bucket", "_start", "_end", "_transport")

    def __init__(self, work: dist.Work, bucket: Bucket, start: int, end: int, transport: AllReduceTransport):
        self._work = work
        self._bucket = bucket  # keeps the buffer alive while the work runs
        self._start, self._end = start, end
        self._transport = transport

    def wait(self, timeout_s: float) -> None:
        bucket = self._bucket
        try:
            wait_or_raise(
                self._work, timeout_s,
                f"the all-reduce of gradient bucket {bucket.index} (elements {self._start}:{self._end} "
                f"of {bucket.wire.numel()}, {bucket.wire_nbytes} bytes in all)",
            )
        except CommunicationTimeout as error:
            self._transport.explain_failure(error)
            raise
        copy_back(bucket, self._start, self._end)

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def on_complete(self, callback: Callable[[], None]) -> None:
        self._work.get_future().add_done_callback(lambda future: callback())


class AllReduceTransport:
    """Averages gradients: each bucket is divided by the world size, then summed with
    ``all_reduce(async_op=True)``, partition by partition, on zero-copy slices (of a
    buffer of ``reduce_dtype`` where the gradients' dtype differs, see
    `commsched.comm.reduce_dtype`)."""

    sums_usage_flags = True
    join_refusal = None

    def __init__(self, process_group: dist.ProcessGroup, reduce_dtype: torch.dtype | None = None):
        """``reduce_dtype``: `commsched.Strategy.reduce_dtype`."""
        self.process_group = process_group
        self.reduce_dtype = reduce_dtype
        self.world_size = dist.get_world_size(process_group)
        self.is_local = self.world_size == 1
        self._backend_name = str(dist.get_backend(process_group))
        self._heartbeat = None if self.is_local else Heartbeat.of_group(process_group)

    def attach(self, bucket_set: BucketSet, partition_bytes: int | None) -> list[Partition]:
        buckets = bucket_set.buckets
        if not self.is_local:  # one replica: nothing is summed
            for bucket in buckets:
                bucket.reduce_in(wire_dtype(bucket.dtype, self.reduce_dtype))
        return make_partitions(
            [b.wire.numel() for b in buckets], [b.wire.element_size() for b in buckets],
            bucket_set.priorities, None if self.is_local else partition_bytes,  # one replica: nothing on the wire
        )

    def bucket_ready(self, bucket: Bucket) -> None:
        if self.world_size > 1:
            average_onto_wire(bucket, self.world_size)

    def begin_iteration(self, iteration: int, new_plan: Sequence[int] | None) -> None:
        if self._heartbeat is not None:
            self._heartbeat.at_iteration(iteration)

    def launch(self, partition: Partition, bucket: Bucket, has_grad: Sequence[bool]) -> Handle:
        if self.is_local:
            return COMPLETED
        start, end = partition.start, partition.end
        work = dist.all_reduce(bucket.wire[start:end], group=self.process_group, async_op=True)
        return _WorkHandle(work, bucket, start, end, self)

    def explain_failure(self, error: CommunicationTimeout) -> None:
        """Name the ranks that stopped beating (see [Note: naming the lost rank])."""
        if self._heartbeat is None:
            return
        lost = self._heartbeat.lost_peers()
        if lost not in str(error):  # not explained on its way up already
            raise CommunicationTimeout(f"{error} {lost}") from error

    def describe(self) -> TransportStatus:
        ranks = f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
        summed = self.reduce_dtype is not None and not self.is_local
        reduce_dtype = f", reduce_dtype={self.reduce_dtype}" if summed else ""
        return TransportStatus(f"all-reduce over {ranks} ({self._backend_name}{reduce_dtype})")

    def finish(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()

    def forget_process_groups(self) -> None:
        self.process_group = None  # type: ignore[assignment]
