"""All-reduce transport: each partition is averaged over the process group in place.

With ``AllReduce(shard_optimizer=True, reduce_scatter=True)``, once warm-up is
over, most buckets are reduce-scattered instead (see [Note: reduce-scattered
buckets] in `commsched.comm.reduce_scatter`). A failed reduction names the lost
rank: see [Note: naming the lost rank] in `commsched.comm.heartbeat`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from commsched.comm import reduce_scatter, two_step
from commsched.comm.heartbeat import Heartbeat
from commsched.comm.powersgd import PowerSGDCompressor
from commsched.comm.reduce_dtype import average_onto_wire, copy_back, wire_dtype
from commsched.comm.reduce_scatter import BucketScattering
from commsched.comm.transport import COMPLETED, Handle, TransportStatus
from commsched.device import order_after_work, runs_nccl
from commsched.errors import CommunicationTimeout, failures_explained, wait_or_raise
from commsched.layout.buckets import Bucket, BucketSet, first_needed
from commsched.layout.partitions import Partition, make_partitions

logger = logging.getLogger("commsched")


class _WorkHandle:
    """A torch.distributed ``Work`` whose failure or timeout becomes a clear error."""

    __slots__ = ("_work", "_bucket", "_partition", "_transport")

    def __init__(self, work: dist.Work, bucket: Bucket, partition: Partition, transport: AllReduceTransport):
        self._work = work
        self._bucket = bucket  # keeps the buffer alive while the work runs
        self._partition = partition
        self._transport = transport

    def wait(self, timeout_s: float) -> None:
        with failures_explained(self._transport.explain_failure):
            wait_or_raise(self._work, timeout_s, _all_reduce_what(self._bucket, self._partition))
        self._finish()

    def order(self) -> bool:
        with failures_explained(self._transport.explain_failure):
            ordered = order_after_work(self._work, self._transport.on_nccl,
                                       _all_reduce_what(self._bucket, self._partition))
        if ordered:
            self._finish()
        return ordered

    def _finish(self) -> None:
        if self._bucket.cast_on_wire:
            copy_back(self._bucket, self._partition.start, self._partition.end)

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def on_complete(self, callback: Callable[[], None]) -> None:
        self._work.get_future().add_done_callback(lambda future: callback())


class _ScatterHandle:
    """A partition's reduce-scatter (`commsched.comm.reduce_scatter.Scatter`), finished once waited for."""

    __slots__ = ("_scatter", "_bucket", "_partition", "_transport")

    def __init__(self, scatter: reduce_scatter.Scatter, bucket: Bucket, partition: Partition,
                 transport: AllReduceTransport):
        self._scatter, self._bucket, self._partition, self._transport = scatter, bucket, partition, transport

    def wait(self, timeout_s: float) -> None:
        with failures_explained(self._transport.explain_failure):
            self._scatter.wait(timeout_s, self._what())
        self._scatter.finish()

    def order(self) -> bool:
        with failures_explained(self._transport.explain_failure):
            ordered = self._scatter.order(self._transport.on_nccl, self._what())
        if ordered:
            self._scatter.finish()
        return ordered

    def _what(self) -> str:
        bucket, partition = self._bucket, self._partition
        return (f"the reduce-scatter of gradient bucket {bucket.index} (elements {partition.start}:{partition.end} "
                f"of each of its {self._transport.world_size} chunks, {bucket.wire_nbytes} bytes in all)")

    def is_completed(self) -> bool:
        return self._scatter.is_completed()

    def on_complete(self, callback: Callable[[], None]) -> None:
        self._scatter.on_complete(callback)


def _join_refusal(compression: PowerSGDCompressor) -> str:
    return (f"Join (uneven inputs) is not supported with Strategy(compression={compression.settings!r}) yet: give "
            "every rank the same number of batches (DistributedSampler(drop_last=True)), or train without compression")


def _all_reduce_what(bucket: Bucket, partition: Partition) -> str:
    return (f"the all-reduce of gradient bucket {bucket.index} (elements {partition.start}:{partition.end} "
            f"of {bucket.wire.numel()}, {bucket.wire_nbytes} bytes in all)")


class _StepsHandle:
    """A partition reduced in two steps (`commsched.comm.two_step.SecondStepOperation`: two
    all-to-alls, or a bucket's PowerSGD all-reduces); copied back to the gradients once waited for
    where summed in another dtype."""

    __slots__ = ("_reduction", "_bucket", "_partition", "_transport")

    def __init__(self, reduction: two_step.SecondStepOperation, bucket: Bucket, partition: Partition,
                 transport: AllReduceTransport):
        self._reduction, self._bucket, self._partition = reduction, bucket, partition
        self._transport = transport

    def wait(self, timeout_s: float) -> None:
        with failures_explained(self._transport.explain_failure):
            self._reduction.wait(timeout_s)
        if self._bucket.cast_on_wire:
            copy_back(self._bucket, self._partition.start, self._partition.end)

    def order(self) -> bool:
        """Second steps are issued from the first's completion on the host: the host waits."""
        return False

    def is_completed(self) -> bool:
        return self._reduction.is_completed()

    def on_complete(self, callback: Callable[[], None]) -> None:
        self._reduction.on_complete(callback)


class AllReduceTransport:
    """Averages gradients: each bucket is divided by the world size, then summed with
    ``all_reduce(async_op=True)``, partition by partition, on zero-copy slices (of a
    buffer of ``reduce_dtype`` where the gradients' dtype differs, see
    `commsched.comm.reduce_dtype`)."""

    sums_usage_flags = True
    join_refusal = None

    def __init__(self, process_group: dist.ProcessGroup, reduce_dtype: torch.dtype | None = None,
                 reduce_scatter: bool = False, exchange_group: dist.ProcessGroup | None = None,
                 all_to_all_mb: float | str | None = None, compression: PowerSGDCompressor | None = None,
                 schedule_one_rank: bool = False):
        """``reduce_dtype``: `commsched.Strategy.reduce_dtype`; ``reduce_scatter``:
        `commsched.AllReduce.reduce_scatter` (from ``scatter.start()`` on); ``exchange_group``: where
        the second steps of two-step all-reduces go, for `commsched.AllReduce.all_to_all_mb`
        (None: never in two steps; see ``two_steps``); ``compression``: `commsched.Strategy.compression`'s
        state, whose second steps go on its own exchange group; ``schedule_one_rank``:
        `commsched.AllReduce.schedule_one_rank`."""
        self.process_group = process_group
        self.reduce_dtype = reduce_dtype
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.is_local = self.world_size == 1 and not schedule_one_rank
        self.on_nccl = False
        """The buckets are on a GPU and the group runs NCCL there (set when they are attached)."""
        self.completion_callbacks = True
        """A handle's ``on_complete`` runs once the reduction is done (gloo); not on NCCL, whose
        future completes as the collective is enqueued."""
        self.scatter = BucketScattering(self.rank, self.world_size) if reduce_scatter and self.world_size > 1 else None
        """Set with ``reduce_scatter``: buckets laid out after its ``start()`` are reduce-scattered."""
        self._backend_name = str(dist.get_backend(process_group))
        self._two_steps = None if exchange_group is None or not all_to_all_mb else two_step.TwoStepRule(
            two_step.SecondSteps.of_group(exchange_group), all_to_all_mb)
        """Set where partitions may go in two steps (see [Note: an all-reduce in two steps])."""
        self.two_steps = self._two_steps if self._two_steps is not None and self._two_steps.first_bucket_only else None
        self._first_bucket = -1
        self._heartbeat = None if self.world_size == 1 else Heartbeat.of_group(process_group)
        self.compression = None if self.world_size == 1 else compression
        """Set with `commsched.Strategy.compression` among two or more ranks."""
        if self.compression is not None:
            self.join_refusal = _join_refusal(self.compression)

    def rewire(self, reduce_dtype: torch.dtype | None, compression: PowerSGDCompressor | None) -> None:
        """Before the layout is made (again): sum in ``reduce_dtype``, compress with ``compression``."""
        self.reduce_dtype = reduce_dtype
        self.compression = None if self.world_size == 1 else compression
        self.join_refusal = None if self.compression is None else _join_refusal(self.compression)

    def attach(self, bucket_set: BucketSet, partition_bytes: int | None) -> list[Partition]:
        buckets = bucket_set.buckets
        if buckets:
            self.on_nccl = runs_nccl(self.process_group, buckets[0].flat.device)
            self.completion_callbacks = not self.on_nccl
        if not self.is_local:  # one replica: nothing is summed
            for bucket in buckets:
                bucket.reduce_in(wire_dtype(bucket.dtype, self.reduce_dtype))
        self._first_bucket = first_needed(bucket_set.priorities)
        scattered = frozenset() if self.scatter is None else self.scatter.attach(bucket_set.priorities)
        if self.compression is not None:
            return self._whole_buckets(bucket_set)
        if scattered:
            return reduce_scatter.cut_partitions(bucket_set, partition_bytes, scattered, self.world_size)
        return make_partitions(
            [b.wire.numel() for b in buckets], [b.wire.element_size() for b in buckets],
            bucket_set.priorities, None if self.is_local else partition_bytes,  # one replica: nothing on the wire
        )

    def _whole_buckets(self, bucket_set: BucketSet) -> list[Partition]:
        """Under compression, each bucket one partition (a matrix is never cut), of the bytes it takes
        compressed: the credit window and the plans count what goes on the wire once compressing."""
        plans = self.compression.attach(bucket_set)
        partitions = []
        for index, (bucket, priority) in enumerate(zip(bucket_set.buckets, bucket_set.priorities, strict=True)):
            plan = plans[index]
            numel = plan.wire_numel if plan.matrices else plan.numel
            partitions.append(Partition(index, index, 0, bucket.wire.numel(), numel * bucket.wire.element_size(),
                                        priority))
        return partitions

    def bucket_ready(self, bucket: Bucket) -> None:
        if self.is_local:
            return
        if not bucket.cast_on_wire:  # the wire is the gradients: averaged in place
            if self.world_size > 1:
                bucket.flat[:bucket.grad_numel].div_(self.world_size)
        else:
            average_onto_wire(bucket, self.world_size)

    def begin_iteration(self, iteration: int, new_plan: Sequence[int] | None) -> None:
        if self._heartbeat is not None:
            self._heartbeat.at_iteration(iteration)
        if self.compression is not None:
            self.compression.begin_iteration()

    def launch(self, partition: Partition, bucket: Bucket, has_grad: Sequence[bool]) -> Handle:
        if self.is_local:
            return COMPLETED
        if self.scatter is not None and bucket.index in self.scatter.scattered:
            scatter = reduce_scatter.Scatter(bucket, partition, self.rank, self.world_size, self.process_group,
                                             by_all_to_all=self._backend_name == "gloo")
            return _ScatterHandle(scatter, bucket, partition, self)
        if self.compression is not None and self.compression.compresses(bucket.index):
            reduction = self.compression.reduce(bucket, self.process_group, _all_reduce_what(bucket, partition))
            return _StepsHandle(reduction, bucket, partition, self)
        wire = bucket.wire[partition.start:partition.end]
        rule = self._two_steps
        if rule is not None and rule.applies(partition.nbytes, bucket.index, self._first_bucket):
            reduction = two_step.TwoStepAllReduce(wire, self.process_group, rule.second_steps,
                                                  _all_reduce_what(bucket, partition))
            return _StepsHandle(reduction, bucket, partition, self)
        work = dist.all_reduce(wire, group=self.process_group, async_op=True)
        return _WorkHandle(work, bucket, partition, self)

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
        scattered = ", reduce-scatter of every bucket but the first" if self.scatter and self.scatter.active else ""
        two_steps = f"; {self._two_steps.why}" if self._two_steps is not None and self._two_steps.why else ""
        compressed = "" if self.compression is None else f", {self.compression.describe()}"
        scheduled = ", the whole schedule at one rank" if self.world_size == 1 and not self.is_local else ""
        return TransportStatus(f"all-reduce over {ranks} ({self._backend_name}{reduce_dtype}{scattered}{compressed}"
                               f"{scheduled}{two_steps})",
                               two_step_max_bytes=None if self._two_steps is None else self._two_steps.max_bytes)

    def finish(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()

    def forget_process_groups(self) -> None:
        self.process_group = None  # type: ignore[assignment]
        self._two_steps = self.two_steps = None

