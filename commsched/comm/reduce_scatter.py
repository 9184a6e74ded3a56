"""Reduce-scattered buckets: ``AllReduce(shard_optimizer=True, reduce_scatter=True)`` (ZeRO-2).

[Note: reduce-scattered buckets] With sharded optimizer state, rank ``r``
updates only chunk ``r`` of every bucket (see [Note: shard layout] in
`commsched.layout.shards`), so it needs only that chunk averaged. A
reduce-scatter gives it exactly that, and moves half an all-reduce's bytes
(with NCCL; gloo's takes as long as its all-reduce: `benchmarks/collectives.py`).

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
from collections.abc import Sequence

import torch
import torch.distributed as dist

from commsched.comm.reduce_dtype import copy_back
from commsched.layout.buckets import Bucket, BucketSet, first_needed
from commsched.layout.partitions import Partition, make_partitions


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
    """One partition's reduce-scatter in flight; `finish` once its work is done."""

    __slots__ = ("work", "_bucket", "_partition", "_rank", "_world_size", "_source", "_received")

    def __init__(self, bucket: Bucket, partition: Partition, rank: int, world_size: int, group: dist.ProcessGroup,
                 by_all_to_all: bool):
        """[Note: reduce-scatter on gloo] gloo's reduce-scatter has no future, so nothing could
        tell the dispatcher it is done without a thread blocked on it, and it takes as long as an
        all-reduce (`benchmarks/collectives.py`). On gloo each rank instead sends every other rank
        that rank's piece with one ``all_to_all_single`` (the bytes of a reduce-scatter, every
        link at once) and sums what it receives, in rank order, once it is done."""
        self._bucket, self._partition, self._rank, self._world_size = bucket, partition, rank, world_size
        chunk = bucket.wire.numel() // world_size
        start, end = partition.start, partition.end
        if start == 0 and end == chunk:
            self._source = bucket.wire
        else:  # the same slice of every chunk, side by side
            self._source = torch.cat([bucket.wire[r * chunk + start:r * chunk + end] for r in range(world_size)])
        if by_all_to_all:
            self._received = torch.empty_like(self._source)
            self.work = dist.all_to_all_single(self._received, self._source, group=group, async_op=True)
        else:
            self._received = None
            self.work = reduce_scatter_single(self._mine(), self._source, group=group, async_op=True)

    def _mine(self) -> torch.Tensor:
        chunk = self._bucket.wire.numel() // self._world_size
        return self._bucket.wire[self._rank * chunk + self._partition.start:self._rank * chunk + self._partition.end]

    def finish(self) -> None:
        """The work is done: this rank's piece summed into the gradients, the others' NaN."""
        bucket, partition, rank, world_size = self._bucket, self._partition, self._rank, self._world_size
        if self._received is not None:
            torch.sum(self._received.view(world_size, -1), dim=0, out=self._mine())
            self._received = None
        self._source = None
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
