"""`GradLayout`: where every gradient lives and travels, fixed once the forward order is agreed.

Built once per prepared model, at ``prepare()`` without priority and after the
first forward pass with it (the order parameters are used in must be seen
first); nothing in it changes afterwards. Per-iteration state lives in
`commsched.engine.backward_pass.BackwardPass`; the issue order in
`commsched.layout.partitions.Plan`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from commsched.layout.buckets import Bucket, BucketSet, bucket_layout
from commsched.layout.partitions import Partition

CutPartitions = Callable[[BucketSet], list[Partition]]
"""The transport's ``attach``: buckets -> partitions."""


@dataclass(frozen=True, eq=False)
class GradLayout:
    """Buckets, slots, partitions and gates of one prepared model."""

    names: tuple[str, ...]
    """Each trainable parameter's name, by slot (its index among them)."""
    params: tuple[torch.nn.Parameter, ...]
    forward_order: tuple[int, ...]
    """Slots in the order the first forward pass used them, as rank 0 saw it."""
    buckets: tuple[Bucket, ...]
    """In the order their gradients are produced (reverse forward order)."""
    bucket_slots: tuple[tuple[int, ...], ...]
    bucket_param_counts: tuple[int, ...]
    """Per bucket, how many parameters it holds (a pass counts them down)."""
    priorities: tuple[int, ...]
    """Per bucket: the forward position of its earliest parameter (lower is more urgent)."""
    bucket_of: tuple[int, ...]
    """Per slot: its bucket."""
    views: tuple[torch.Tensor, ...]
    """Per slot: its gradient, a view into its bucket's flat buffer."""
    flags_bucket: int
    """The bucket holding the first parameter of the forward pass: issued last, at the end
    of backward, and carrying the usage flags (see [Note: unused parameters])."""
    partitions: tuple[Partition, ...]

    def partition_of_slots(self) -> tuple[int, ...]:
        """Per slot: the partition holding its gradient's first element (the wire's unit it goes in)."""
        first: list[int] = [0] * len(self.bucket_of)
        for bucket, slots in zip(self.buckets, self.bucket_slots, strict=True):
            mine = sorted((p for p in self.partitions if p.bucket == bucket.index), key=lambda p: p.start)
            for slot, offset in zip(slots, bucket.offsets, strict=True):
                first[slot] = next((p.pid for p in mine if p.start <= offset < p.end), mine[-1].pid)
        return tuple(first)


def build_layout(
    names: Sequence[str],
    params: Sequence[torch.nn.Parameter],
    forward_order: Sequence[int],
    bucket_size_limits: Sequence[int],
    usage_flags: bool,
    cut: CutPartitions,
    verdict_slots: int = 0,
    chunk_padding: int = 1,
) -> GradLayout:
    """Buckets in reverse forward order, their flat buffers and partitions.

    Gradients that exist already move into their buckets. ``usage_flags``: give
    the flags bucket one extra element per parameter, then ``verdict_slots`` more
    (see [Note: non-finite gradients] in `commsched.engine.finite`). ``chunk_padding``:
    pad every other bucket to a multiple of that many elements (see [Note:
    reduce-scattered buckets] in `commsched.comm.reduce_scatter`).
    """
    bucket_slots, priorities = bucket_layout(params, forward_order, bucket_size_limits)
    flags_bucket = next(b for b, slots in enumerate(bucket_slots) if forward_order[0] in slots)
    views: list[torch.Tensor] = [torch.empty(0)] * len(params)
    bucket_of = [0] * len(params)
    buckets = []
    for b, slots in enumerate(bucket_slots):
        # One bucket at a time, its gradients moved in at once: an old bucket whose
        # gradients have all moved is freed before the next new one is made.
        if b == flags_bucket:
            tail_numel = len(params) + verdict_slots if usage_flags else 0
        else:
            tail_numel = -sum(params[s].numel() for s in slots) % chunk_padding
        bucket = Bucket(b, [params[s] for s in slots], tail_numel=tail_numel)
        buckets.append(bucket)
        for slot, view in zip(slots, bucket.grad_views, strict=True):
            views[slot] = view
            bucket_of[slot] = bucket.index
            grad = params[slot].grad
            if grad is not None:
                view.copy_(grad)
                params[slot].grad = view
    partitions = cut(BucketSet(tuple(forward_order), bucket_slots, priorities, buckets))
    return GradLayout(
        names=tuple(names), params=tuple(params), forward_order=tuple(forward_order), buckets=tuple(buckets),
        bucket_slots=tuple(map(tuple, bucket_slots)), bucket_param_counts=tuple(map(len, bucket_slots)),
        priorities=tuple(priorities), bucket_of=tuple(bucket_of),
        views=tuple(views), flags_bucket=flags_bucket, partitions=tuple(partitions),
    )


def gating_modules(
    root: torch.nn.Module,
    params: Sequence[torch.nn.Parameter],
    read_before_owner: Mapping[int, torch.nn.Module],
) -> list[list[torch.nn.Module]]:
    """Per slot, the modules whose forward gate waits for it: the modules that own it, and
    the one that read it before they ran (``nn.MultiheadAttention`` reads ``out_proj``'s;
    the root, for ``F.linear(x, self.head.weight)`` in its own forward). See `commsched.engine.hooks.ForwardGates`."""
    slot_of = {id(p): s for s, p in enumerate(params)}
    gates: list[list[torch.nn.Module]] = [[] for _ in params]
    for module in root.modules():
        for param in module._parameters.values():
            if param is not None and id(param) in slot_of:
                gates[slot_of[id(param)]].append(module)
    for slot, reader in read_before_owner.items():
        if not any(module is reader for module in gates[slot]):
            gates[slot].append(reader)
    return gates
