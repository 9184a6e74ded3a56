"""Reduce-scattered buckets: ``AllReduce(shard_optimizer=True, reduce_scatter=True)`` (ZeRO-2).

[Note: reduce-scattered buckets] With sharded optimizer state, rank ``r``
updates only chunk ``r`` of every bucket (see [Note: shard layout] in
`commsched.layout.shards`), so it needs only that chunk averaged. A
reduce-scatter gives it exactly that, and moves half an all-reduce's bytes
(with NCCL; gloo's takes as long as its all-reduce: `benchmarks/collectives.py` at 4f3da97).

- Which buckets: every one but the bucket the forward pass needs first. That
  one carries the usage flags (see [Note: unused parameters] in
  `commsched.engine.backward_pass`), which every rank must read summed, and
  when small every rank updates it whole (see [Note: the first bucket is not
  sharded] in `commsched.update.sharded`): it is all-reduced.
- Partitions: a partition of a scattered bucket is the same slice ``[start,
  end)`` of every rank's chunk, so it is one reduce-scatter of ``world_size``
  equal pieces, and the credit window and the plan work as with all-reduce. Its
  size counts all of them, as an all-reduce's would.
- Buckets are padded to a multiple of the world size (`chunk_padding`), so the
  chunks are equal and the padding is never a gradient.
- After the reduction, the other ranks' chunks of ``param.grad`` hold this
  rank's own unaveraged gradients. Read there, they would be silently wrong
  (a norm, a log), so they are filled with NaN: wrong loudly. ``zero_grad()``
  clears them, as it clears any gradient; a backward pass that would add to
  them (two before one ``step()``, or gradients kept across steps) is refused
  (`BackwardPass.gradients_left_scattered`). So is a loop that changes them
  before ``step()`` or a ``GradScaler`` (they need the whole average): when
  warm-up, which all-reduces, sees one, the buckets stay all-reduced for good.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from commsched.comm.reduce_dtype import copy_back
from commsched.device import order_after_work
from commsched.errors import wait_or_raise
from commsched.layout.buckets import Bucket, BucketSet, first_needed
from commsched.layout.partitions import Partition, make_partitions


class BucketScattering:
    """The all-reduce transport's reduce-scatter (its `commsched.comm.transport.Scattering`): which
    buckets of the layout in use are scattered, and what each rank holds averaged afterwards."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.chunk_padding = world_size
        """Buckets but the first in forward order are padded to a multiple of this many elements,
        from the start, so that scattering needs no new layout of its own (one element per rank at most)."""
        self.active = False
        """Buckets laid out from now on are reduce-scattered (see `start`)."""
        self.scattered: frozenset[int] = frozenset()
        """The buckets of the current layout that are reduce-scattered."""

    def start(self) -> None:
        self.active = True

    def attach(self, priorities: Sequence[int]) -> frozenset[int]:
        """A new layout: the buckets it scatters (none before `start`)."""
        self.scattered = scattered_buckets(priorities, self.world_size) if self.active else frozenset()
        return self.scattered

    def averaged_range(self, bucket: Bucket) -> tuple[int, int]:
        if bucket.index in self.scattered:
            return averaged_range(bucket, self.rank, self.world_size)
        return 0, bucket.grad_numel


def scattered_buckets(priorities: Sequence[int], world_size: int) -> frozenset[int]:
    """The buckets to reduce-scatter: all but the one the forward pass needs first (priority 0)."""
    if world_size < 2 or len(priorities) < 2:
        return frozenset()
    first = first_needed(priorities)
    return frozenset(b for b in range(len(priorities)) if b != first)


def cut_partitions(bucket_set: BucketSet, partition_bytes: int | None, scattered: frozenset[int],
                   world_size: int) -> list[Partition]:
    """Partitions of every bucket: all-reduced buckets as slices of their buffer, scattered
    ones as the same slice of every rank's chunk (``nbytes`` counting every rank's piece)."""
    numels, element_sizes = [], []
    for bucket in bucket_set.buckets:
        if bucket.index in scattered:
            numels.append(bucket.wire.numel() // world_size)
            element_sizes.append(bucket.wire.element_size() * world_size)
        else:
            numels.append(bucket.wire.numel())
            element_sizes.append(bucket.wire.element_size())
    return make_partitions(numels, element_sizes, bucket_set.priorities, partition_bytes)


reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""torch's reduce-scatter of one tensor into equal chunks (named ``reduce_scatter_tensor`` before 2.13)."""


class Scatter:
    """One partition's reduce-scatter in flight; `finish` once it is done (the work's own handle:
    `wait`, `is_completed`, `on_complete`)."""

    __slots__ = ("_work", "_bucket", "_partition", "_rank", "_world_size", "_source", "_received", "_lock",
                 "_by_all_to_all")

    def __init__(self, bucket: Bucket, partition: Partition, rank: int, world_size: int, group: dist.ProcessGroup,
                 by_all_to_all: bool):
        """[Note: reduce-scatter on gloo] gloo's reduce-scatter has no future, so nothing could
        tell the dispatcher it is done without a thread blocked on it, and it takes as long as an
        all-reduce (`benchmarks/collectives.py` at 4f3da97). On gloo each rank instead sends every other rank
        that rank's piece with one ``all_to_all_single`` (the bytes of a reduce-scatter, every
        link at once) and sums what it receives, in rank order, once it is done.

        [Note: summed as it arrives] What the all-to-all receives is as large as the partition
        (every rank's piece of it), and gloo's work keeps its tensors until the work itself goes.
        The pass keeps its handles until the next pass, so every partition's received pieces (and
        the copy it sent, where it is part of a chunk) stayed alive all along: up to two more
        copies of the scattered gradients (on a 22M-parameter MLP with Adam, 2 ranks, the RSS
        after ``step()`` was 55 MiB above the all-reducing sharded mode's). So, on the
        communication thread that completes the all-to-all (as the first step of a two-step
        all-reduce is summed, `commsched.comm.two_step`), this rank's piece is summed and the work
        let go, and with it what it received (or by `finish`, if the wait came first). A failed
        work is kept, for `wait` to raise. Tensors on a GPU are summed where the pass waits, on the
        streams it orders, and the work goes there; NCCL's work stays as before: its wait only
        orders the streams, and the work keeps its tensors for the kernel still running."""
        self._bucket, self._partition, self._rank, self._world_size = bucket, partition, rank, world_size
        self._by_all_to_all = by_all_to_all
        self._lock = threading.Lock()
        chunk = bucket.wire.numel() // world_size
        start, end = partition.start, partition.end
        if start == 0 and end == chunk:
            self._source = bucket.wire
        else:  # the same slice of every chunk, side by side
            self._source = torch.cat([bucket.wire[r * chunk + start:r * chunk + end] for r in range(world_size)])
        if by_all_to_all:
            self._received = torch.empty_like(self._source)
            work = dist.all_to_all_single(self._received, self._source, group=group, async_op=True)
        else:
            self._received = None
            work = reduce_scatter_single(self._mine(), self._source, group=group, async_op=True)
        self._work: dist.Work | None = work
        """None once the all-to-all is done and summed (its buffers gone with it)."""
        if by_all_to_all and self._source.device.type == "cpu":
            # With CUDA tensors the sum stays on the thread that waits, on the streams it orders.
            work.get_future().add_done_callback(self._arrived)

    def _mine(self) -> torch.Tensor:
        chunk = self._bucket.wire.numel() // self._world_size
        return self._bucket.wire[self._rank * chunk + self._partition.start:self._rank * chunk + self._partition.end]

    def _arrived(self, completed: torch.futures.Future) -> None:
        """On a communication thread, the all-to-all done: see [Note: summed as it arrives]."""
        try:
            completed.value()
        except Exception:  # noqa: BLE001 - the work stays, and its wait raises it
            return
        with self._lock:
            self._sum_received()
            self._work = None

    def _sum_received(self) -> None:
        """This rank's piece summed from what the all-to-all received (once; under the lock)."""
        if self._received is not None:
            torch.sum(self._received.view(self._world_size, -1), dim=0, out=self._mine())
            self._received = None
        self._source = None

    def wait(self, timeout_s: float, what: str) -> None:
        work = self._work
        if work is not None:
            wait_or_raise(work, timeout_s, what)

    def order(self, on_nccl: bool, what: str) -> bool:
        """The current stream waits for the work, the host does not (see [Note: ordering after a
        work] in commsched/device.py); False where it cannot, and nothing was done."""
        work = self._work
        return work is None or order_after_work(work, on_nccl, what)

    def is_completed(self) -> bool:
        work = self._work
        return work is None or work.is_completed()

    def on_complete(self, callback: Callable[[], None]) -> None:
        """``callback`` once done: after the sum, since `_arrived` was attached first."""
        work = self._work
        if work is None:
            callback()
        else:
            work.get_future().add_done_callback(lambda _: callback())

    def finish(self) -> None:
        """The work is done (`wait`): this rank's piece summed into the gradients, the others' NaN."""
        bucket, partition, rank, world_size = self._bucket, self._partition, self._rank, self._world_size
        with self._lock:
            self._sum_received()
            if self._by_all_to_all:
                self._work = None
        chunk = bucket.wire.numel() // world_size
        for r in range(world_size):
            low, high = r * chunk + partition.start, min(r * chunk + partition.end, bucket.grad_numel)
            if low >= high:
                continue
            if r == rank:
                copy_back(bucket, low, high)
            else:
                bucket.flat.data[low:high].fill_(math.nan)


def averaged_range(bucket: Bucket, rank: int, world_size: int) -> tuple[int, int]:
    """Where ``bucket``'s gradients hold the average on this rank, once reduce-scattered."""
    chunk = bucket.wire.numel() // world_size
    return min(rank * chunk, bucket.grad_numel), min((rank + 1) * chunk, bucket.grad_numel)
