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
import torch.distributed as dist

from commsched.layout.buckets import view_like
from commsched.layout.shards import BucketShard, Fragment
from commsched.update.sharded_layout import FragmentStates, FullState, ShardCut, StateKinds

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""torch's gather of equal chunks into one tensor (named ``all_gather_into_tensor`` before 2.13)."""

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


# ----------------------------------------------- gathering and moving a cut's state
Wait = Callable[[dist.Work, str], None]
"""Waits for a collective, naming what it is in the error if it fails."""

State = Mapping[torch.Tensor, dict[str, Any]]
"""Per fragment of the cut (its view), its state (the sharded update's own, changed in place)."""


def reshard_state(cut: ShardCut, state: dict[torch.Tensor, dict[str, Any]], kinds: StateKinds,
                  new_bucket_params: Sequence[Sequence[torch.nn.Parameter]], new_shards: Sequence[BucketShard],
                  group: dist.ProcessGroup, wait: Wait) -> FragmentStates:
    """This rank's fragments of the state in a new layout (collective on ``group``): each old
    bucket's state moved a piece at a time, its old fragments let go (from ``state``) before the
    next; see [Note: resharding one bucket at a time]."""
    targets = new_fragments_by_param(new_bucket_params, new_shards)
    moved: FragmentStates = {}
    for bucket in range(len(cut.shards)):
        _move_bucket_state(cut, state, kinds, bucket, targets, moved, group, wait)
        for _, piece in cut.fragments[bucket]:
            state.pop(piece, None)
    return moved


def _move_bucket_state(cut: ShardCut, state: dict[torch.Tensor, dict[str, Any]], kinds: StateKinds, bucket: int,
                       targets: NewFragments, moved: FragmentStates, group: dist.ProcessGroup, wait: Wait) -> None:
    """Old ``bucket``'s state into the new fragments (``targets``) that hold it, in ``moved``, one
    kind at a time: each kind's new tensors are made just before it moves, its old ones let go
    right after, so the bucket's state exists about once, not twice."""
    shard, flat, params = cut.shards[bucket], cut.flats[bucket], cut.bucket_params[bucket]
    has_state, steps = presence(cut, state, bucket, group, wait)
    receivers = []
    for position, param in enumerate(params):
        keys = kinds.keys_of(param)
        if not has_state[position] or keys is None:
            continue
        for fragment_key, fragment in targets.get(id(param), ()):
            entry = moved.setdefault(fragment_key, {})
            if kinds.has_step:
                entry["step"] = torch.tensor(steps[position], dtype=torch.float32)
            receivers.append((entry, fragment.numel, keys, param.dtype))
    stretch = piece_elements(flat.element_size(), shard.world_size)
    for key in kinds.state_keys(params):
        for entry, numel, keys, dtype in receivers:
            if key in keys:
                entry[key] = torch.zeros(numel, dtype=dtype, device=flat.device)

        def gather(mine: torch.Tensor, key: str = key) -> torch.Tensor:
            gathered = torch.empty(mine.numel() * shard.world_size, dtype=mine.dtype, device=mine.device)
            wait(all_gather_single(gathered, mine, group=group, async_op=True),
                 f"the all-gather of optimizer state {key!r}")
            return gathered

        move_kind(key, shard, [(fragment, state.get(piece, {}).get(key)) for fragment, piece in cut.fragments[bucket]],
                  flat, params, targets, moved, stretch, gather)
        for _, piece in cut.fragments[bucket]:
            state.get(piece, {}).pop(key, None)


def presence(cut: ShardCut, state: State, bucket: int, group: dist.ProcessGroup,
             wait: Wait) -> tuple[list[float], list[float]]:
    """Per parameter of ``bucket``, whether some rank holds state for it, and its step
    (collective: one all-reduce)."""
    shard, params = cut.shards[bucket], cut.bucket_params[bucket]
    found = torch.zeros(2 * len(params), dtype=torch.float64, device=cut.flats[bucket].device)
    for fragment, piece in cut.fragments[bucket]:
        held = state.get(piece)
        if held:
            found[fragment.position] = 1
            step = held.get("step")
            found[len(params) + fragment.position] = float(step) if step is not None else 0.0
    if shard.world_size > 1:
        wait(dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group, async_op=True),
             "the all-reduce of which parameters have optimizer state")
    return found[:len(params)].tolist(), found[len(params):].tolist()


def gather_bucket(cut: ShardCut, state: State, kinds: StateKinds, bucket: int, group: dist.ProcessGroup,
                  wait: Wait) -> FullState:
    """The whole state of ``bucket``'s parameters, on every rank (collective): one all-gather
    per kind of state tensor, and one all-reduce of which parameters have state and their
    step. The tensors are views into one buffer per kind."""
    shard, flat, params = cut.shards[bucket], cut.flats[bucket], cut.bucket_params[bucket]
    fragments = cut.fragments[bucket]
    gathered: FullState = {}
    has_state, steps = presence(cut, state, bucket, group, wait)
    offsets = back_to_back_offsets(params)
    tensors: dict[str, torch.Tensor] = {}
    for key in kinds.state_keys(params):
        full = torch.zeros(shard.padded_numel, dtype=flat.dtype, device=flat.device)
        for fragment, piece in fragments:
            value = state.get(piece, {}).get(key)
            if value is not None:
                full[fragment.bucket_offset:fragment.bucket_offset + fragment.numel].copy_(value)
        if shard.world_size > 1:
            mine = full[shard.start:shard.start + shard.chunk]
            wait(all_gather_single(full, mine, group=group, async_op=True),
                 f"the all-gather of optimizer state {key!r}")
        tensors[key] = full
    for position, param in enumerate(params):
        keys = kinds.keys_of(param)
        if not has_state[position] or keys is None:
            continue
        held = {key: view_like(tensors[key], offsets[position], param) for key in keys}
        if kinds.has_step:
            held["step"] = torch.tensor(steps[position], dtype=torch.float32)
        gathered[param] = held
    return gathered
