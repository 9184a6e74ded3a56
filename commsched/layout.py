"""`GradLayout`: where every gradient lives and travels, fixed once the forward order is agreed.

Built once per prepared model, at ``prepare()`` without priority and after the
first forward pass with it (the order parameters are used in must be seen
first); nothing in it changes afterwards. Per-iteration state lives in
`commsched.backward_pass.BackwardPass`; the issue order in
`commsched.scheduler.Plan`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from commsched.buckets import Bucket, BucketSet, bucket_layout
from commsched.scheduler import Partition

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
    gated_modules: tuple[tuple[torch.nn.Module, tuple[int, ...]], ...]
    """Each module (but the root) that owns parameters or reads others' before their
    module runs (``nn.MultiheadAttention`` reads ``out_proj``'s), with the buckets they live in."""
    root_buckets: tuple[int, ...]
    """Buckets the root must wait for before its forward: its own parameters', and those
    it reads before their module runs (``F.linear(x, self.head.weight)``)."""


def build_layout(
    root: torch.nn.Module,
    names: Sequence[str],
    params: Sequence[torch.nn.Parameter],
    forward_order: Sequence[int],
    read_before_owner: Mapping[int, torch.nn.Module],
    bucket_size_limits: Sequence[int],
    usage_flags: bool,
    cut: CutPartitions,
) -> GradLayout:
    """Buckets in reverse forward order, their flat buffers and partitions, and the gates.

    Gradients that exist already move into their buckets. ``usage_flags``: give
    the flags bucket one extra element per parameter. ``read_before_owner``: per
    slot read before its module ran, the module that read it (`ForwardRecorder.read_by`).
    """
    bucket_slots, priorities = bucket_layout(params, forward_order, bucket_size_limits)
    flags_bucket = next(b for b, slots in enumerate(bucket_slots) if forward_order[0] in slots)
    views: list[torch.Tensor] = [torch.empty(0)] * len(params)
    bucket_of = [0] * len(params)
    buckets = []
    for b, slots in enumerate(bucket_slots):
        # One bucket at a time, its gradients moved in at once: an old bucket whose
        # gradients have all moved is freed before the next new one is made.
        tail_numel = len(params) if usage_flags and b == flags_bucket else 0
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
    gated, root_slots = _gates(root, params, bucket_of, read_before_owner)
    return GradLayout(
        names=tuple(names), params=tuple(params), forward_order=tuple(forward_order), buckets=tuple(buckets),
        bucket_slots=tuple(map(tuple, bucket_slots)), bucket_param_counts=tuple(map(len, bucket_slots)),
        priorities=tuple(priorities), bucket_of=tuple(bucket_of),
        views=tuple(views), flags_bucket=flags_bucket, partitions=tuple(partitions), gated_modules=gated,
        root_buckets=tuple(sorted({bucket_of[s] for s in root_slots})),
    )


def _gates(
    root: torch.nn.Module,
    params: Sequence[torch.nn.Parameter],
    bucket_of: Sequence[int],
    read_before_owner: Mapping[int, torch.nn.Module],
) -> tuple[tuple[tuple[torch.nn.Module, tuple[int, ...]], ...], set[int]]:
    """Per module, the buckets of the parameters it owns or reads before their module
    runs; and the slots the root waits for."""
    slot_of = {id(p): s for s, p in enumerate(params)}
    read_by = slots_by_reader(read_before_owner)
    gated = []
    root_slots: set[int] = set()
    for module in root.modules():
        slots = {slot_of[id(p)] for p in module._parameters.values() if p is not None and id(p) in slot_of}
        slots.update(read_by.get(id(module), ()))
        if slots and module is not root:
            gated.append((module, tuple(sorted({bucket_of[s] for s in slots}))))
        elif slots:
            root_slots |= slots
    return tuple(gated), root_slots


def slots_by_reader(read_before_owner: Mapping[int, torch.nn.Module]) -> dict[int, list[int]]:
    """Per reading module (by ``id``), the slots it read before their own module ran, in order of first read."""
    by_reader: dict[int, list[int]] = {}
    for slot, module in read_before_owner.items():
        by_reader.setdefault(id(module), []).append(slot)
    return by_reader
