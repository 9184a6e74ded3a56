"""Gradient buckets: which parameters travel together, and their flat buffers.

Each bucket owns one contiguous buffer of a single dtype and device, and every
parameter's ``.grad`` is a view into it, so autograd accumulates straight into
the memory that goes on the wire: no copy before or after a reduction (unless
the gradients are summed in another dtype, `Bucket.reduce_in`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


def compute_bucket_assignment_by_size(
    tensors: Sequence[torch.Tensor], bucket_size_limits: Sequence[int]
) -> list[list[int]]:
    """Group tensor indices into buckets of at most about ``bucket_size_limits`` bytes.

    Tensors are taken in order and accumulated per (dtype, device). A bucket is
    closed as soon as its size reaches the current limit of its (dtype, device);
    each closed bucket advances that key to the next limit, and the last limit
    repeats. Leftover buckets are closed at the end. Buckets come back sorted by
    the smallest index they hold, so if ``tensors`` is in the order gradients are
    produced, buckets are in the order they become ready.
    """
    limits = [int(limit) for limit in bucket_size_limits]
    if not limits:
        raise ValueError("bucket_size_limits must hold at least one limit, got []")
    if any(limit <= 0 for limit in limits):
        raise ValueError(f"every bucket size limit must be > 0 bytes, got {limits}")

    result: list[list[int]] = []
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    limit_position: dict[tuple[torch.dtype, torch.device], int] = {}
    for index, tensor in enumerate(tensors):
        if tensor.is_sparse:
            raise ValueError(f"tensor {index} is sparse; only dense tensors can be bucketed")
        key = (tensor.dtype, tensor.device)
        indices, size_bytes = open_buckets.get(key, ([], 0))
        indices.append(index)
        size_bytes += tensor.numel() * tensor.element_size()
        position = limit_position.setdefault(key, 0)
        if size_bytes >= limits[position]:
            result.append(indices)
            open_buckets[key] = ([], 0)
            limit_position[key] = min(position + 1, len(limits) - 1)
        else:
            open_buckets[key] = (indices, size_bytes)

    result.extend(indices for indices, _ in open_buckets.values() if indices)
    result.sort(key=min)
    return result


def bucket_layout(
    params: Sequence[torch.Tensor], forward_order: Sequence[int], bucket_size_limits: Sequence[int]
) -> tuple[list[list[int]], list[int]]:
    """Buckets of parameter slots in reverse forward order, and each bucket's priority.

    A bucket's priority is the forward position of its earliest parameter (lower
    is more urgent). Workers and parameter servers both derive their layout
    from this function, so it must stay deterministic.
    """
    backward_order = list(forward_order)[::-1]
    forward_position = {slot: i for i, slot in enumerate(forward_order)}
    assignment = compute_bucket_assignment_by_size([params[s] for s in backward_order], bucket_size_limits)
    bucket_slots = [[backward_order[i] for i in indices] for indices in assignment]
    priorities = [min(forward_position[s] for s in slots) for slots in bucket_slots]
    return bucket_slots, priorities


class Bucket:
    """One flat gradient buffer and the parameters whose gradients are views into it.

    ``tail_numel`` extra elements after the gradients belong to the bucket's owner
    (the reducer keeps per-parameter flags there so they travel in the same
    collective; a reduce-scattered bucket is padded there to equal chunks).
    """

    def __init__(self, index: int, params: Sequence[torch.nn.Parameter], tail_numel: int = 0):
        if not params:
            raise ValueError("a bucket needs at least one parameter")
        dtype, device = params[0].dtype, params[0].device
        for param in params:
            if param.dtype != dtype or param.device != device:
                raise ValueError(
                    "parameters of one bucket must share dtype and device, got "
                    f"{dtype}/{device} and {param.dtype}/{param.device}"
                )
        self.index = index
        self.params = list(params)
        self.offsets: list[int] = []
        numel = 0
        for param in self.params:
            self.offsets.append(numel)
            numel += param.numel()
        self.grad_numel = numel
        self.flat = torch.zeros(numel + tail_numel, dtype=dtype, device=device)
        self.grad_views = [
            view_like(self.flat, offset, param) for offset, param in zip(self.offsets, self.params)
        ]
        self.tail = self.flat[numel:]
        self.dtype: torch.dtype = dtype
        self.nbytes = self.flat.numel() * self.flat.element_size()
        self._wire_is(self.flat.data)

    def _wire_is(self, wire: torch.Tensor) -> None:
        # Plain attributes, not properties: the transport reads them once per bucket and per wait.
        self.wire = wire
        """The buffer as transports write it: the same memory with a version counter of its
        own. A backend that writes results back with an in-place copy (gloo with CUDA
        tensors) then bumps only this one, so the gradient-touch guard, which reads
        ``flat``'s counter (shared by the gradient views), sees only the user's writes.
        After `reduce_in` another dtype, a buffer of its own."""
        self.wire_dtype: torch.dtype = wire.dtype
        """The dtype the bucket is summed in across ranks."""
        self.wire_nbytes = wire.numel() * wire.element_size()
        self.cast_on_wire = self.wire_dtype != self.dtype
        """Summed in another dtype than the gradients': cast onto ``wire`` and back
        (`commsched.comm.reduce_dtype`); else ``wire`` is the gradients' own memory."""

    def reduce_in(self, dtype: torch.dtype) -> None:
        """Sum this bucket's gradients in ``dtype`` (`commsched.Strategy.reduce_dtype`).

        ``param.grad`` must keep the parameter's dtype, so the gradients stay where they
        are and ``wire`` becomes a buffer of ``dtype`` as long as ``flat``; the transport
        casts into it and back (`commsched.comm.reduce_dtype`). The flags ``tail`` moves
        there, since it is written after the cast and read after the sum.
        """
        if dtype == self.dtype:
            return
        self._wire_is(torch.zeros(self.flat.numel(), dtype=dtype, device=self.flat.device))
        self.tail = self.wire[self.grad_numel:]

    def __repr__(self) -> str:
        wire = "" if self.wire_dtype == self.dtype else f", reduced in {self.wire_dtype}"
        return (
            f"Bucket(index={self.index}, params={len(self.params)}, "
            f"dtype={self.dtype}, bytes={self.nbytes}{wire})"
        )


def view_like(flat: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    """A view of ``flat`` starting at ``offset`` with ``param``'s shape and strides.

    Matching the strides (e.g. channels_last weights) keeps autograd's layout
    contract, so it accumulates in place instead of replacing the gradient.
    """
    segment = flat[offset : offset + param.numel()]
    if param.is_contiguous():
        return segment.view(param.shape)
    dense_strides = torch.empty_like(param, device="meta").stride()
    return segment.as_strided(param.shape, dense_strides)


def first_needed(priorities: Sequence[int]) -> int:
    """The bucket the forward pass needs first (priority 0; the lowest index on a tie), -1 if none."""
    return min(range(len(priorities)), key=lambda b: (priorities[b], b), default=-1)


class BucketSet(NamedTuple):
    """A model's buckets and how they came about: what a transport cuts into partitions."""

    forward_order: Sequence[int]
    """Parameter slots in the order the forward pass uses them."""
    bucket_slots: Sequence[Sequence[int]]
    """Per bucket, its parameters' slots (buckets in reverse forward order)."""
    priorities: Sequence[int]
    """Per bucket, the forward position of its earliest parameter (lower is more urgent)."""
    buckets: Sequence[Bucket]
