"""Moving sharded optimizer state into a new layout, a piece of a bucket at a time.

[Note: resharding one bucket at a time] A new layout (the end of warm-up, a
switch to another bucket size, the auto-tuner's switch points) gives every rank
other fragments. Each old bucket's state is moved on its own, one kind of state
tensor after the other (Adam's ``exp_avg``, then ``exp_avg_sq``), in pieces: an
all-gather of at most `RESHARD_PIECE_BYTES` carries the same stretch of every
rank's chunk, and each rank copies from it what its new fragments hold. A kind's
new tensors are made just before it moves and its old ones let go right after,
so the bucket's state exists about once, not twice. What resharding holds beyond
the state itself is then one piece and one kind of one bucket's share, whatever
the bucket's size. Gathering every bucket's whole state first held the whole
model's state on every rank (a peak above the unsharded backend's); gathering
each bucket whole still held a bucket's state of every kind, and gloo stages a
buffer the gathered size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from commsched.layout.shards import BucketShard, Fragment

RESHARD_PIECE_BYTES = 4 * 2**20
"""The most one all-gather of resharding gathers (every rank's stretch together)."""

NewFragments = dict[int, list[tuple[tuple[int, int], Fragment]]]
"""Per parameter (by ``id``), the fragments this rank owns of it in the new layout, each with
its key (bucket, number among this rank's fragments of that bucket)."""


def new_fragments_by_param(bucket_params: Sequence[Sequence[torch.Tensor]],
                           shards: Sequence[BucketShard]) -> NewFragments:
    """Where each parameter's elements go in the new layout (``bucket_params``: its buckets' parameters)."""
    found: NewFragments = {}
    for index, (params, shard) in enumerate(zip(bucket_params, shards, strict=True)):
        for number, fragment in enumerate(shard.fragments):
            found.setdefault(id(params[fragment.position]), []).append(((index, number), fragment))
    return found


def piece_elements(element_size: int, world_size: int) -> int:
    """How many elements of each rank's chunk one all-gather of resharding carries."""
    return max(1, RESHARD_PIECE_BYTES // (element_size * world_size))


def back_to_back_offsets(params: Sequence[torch.Tensor]) -> list[int]:
    """Where each of ``params`` starts in a flat buffer that holds them back to back."""
    offsets, total = [], 0
    for param in params:
        offsets.append(total)
        total += param.numel()
    return offsets


def move_kind(key: str, shard: BucketShard, held: Sequence[tuple[Fragment, torch.Tensor | None]],
              like: torch.Tensor, params: Sequence[torch.Tensor], targets: NewFragments,
              into: Mapping[tuple[int, int], dict[str, Any]], stretch: int,
              gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Move one kind of an old bucket's state (``key``) into the new fragments (``targets``; ``into``:
    their state, with a zeroed tensor of ``key`` where the parameter has that state), ``stretch``
    elements of every rank's chunk at a time. ``held``: this rank's old fragments (``shard``'s), each
    with its tensor of that kind or None; ``like``: the bucket's flat buffer (dtype, device);
    ``params``: the old bucket's, back to back; ``gather``: every rank's stretch, in rank order, from
    this rank's (the collective; not called where the bucket is one rank's)."""
    offsets = back_to_back_offsets(params)
    for begin in range(0, shard.chunk, stretch):
        length = min(stretch, shard.chunk - begin)
        mine = torch.zeros(length, dtype=like.dtype, device=like.device)
        _own_stretch(mine, shard.start + begin, held)
        gathered = gather(mine) if shard.world_size > 1 else mine
        for rank in range(shard.world_size):
            _take_stretch(gathered[rank * length:(rank + 1) * length], rank * shard.chunk + begin, params, offsets,
                          targets, key, into)


def _own_stretch(out: torch.Tensor, begin: int, held: Sequence[tuple[Fragment, torch.Tensor | None]]) -> None:
    """Fill ``out`` with the bucket's elements ``[begin, begin + len(out))`` of one kind of state,
    from this rank's old fragments (``held``: each with its tensor of that kind, or None)."""
    end = begin + out.numel()
    for fragment, value in held:
        if value is None:
            continue
        low = max(fragment.bucket_offset, begin)
        high = min(fragment.bucket_offset + fragment.numel, end)
        if low < high:
            out[low - begin:high - begin].copy_(value[low - fragment.bucket_offset:high - fragment.bucket_offset])


def _take_stretch(values: torch.Tensor, begin: int, params: Sequence[torch.Tensor], offsets: Sequence[int],
                  targets: NewFragments, key: str, into: Mapping[tuple[int, int], dict[str, Any]]) -> None:
    """Copy the old bucket's elements ``[begin, begin + len(values))`` of state ``key`` into the new
    fragments that hold them (``into``: their state, with a zeroed tensor of ``key`` where the
    parameter has that state; ``params`` and ``offsets``: the old bucket's, back to back)."""
    end = begin + values.numel()
    for param, offset in zip(params, offsets, strict=True):
        low, high = max(offset, begin), min(offset + param.numel(), end)
        if low >= high:
            continue
        for fragment_key, fragment in targets.get(id(param), ()):
            tensor = into.get(fragment_key, {}).get(key)
            first, last = max(low - offset, fragment.start), min(high - offset, fragment.end)
            if tensor is not None and first < last:
                tensor[first - fragment.start:last - fragment.start].copy_(
                    values[first + offset - begin:last + offset - begin])
