"""Gradients summed in another dtype than their parameters' (`commsched.Strategy.reduce_dtype`).

Which dtype each bucket goes on the wire in, and the casts on either side of
the sum. The average is taken in the wider of the two dtypes, before the cast
to the narrower one: a float32 gradient is divided by the world size and then
rounded once to bfloat16 (torch DDP's ``bf16_compress_hook`` rounds, then
divides in bfloat16: a second rounding wherever the world size is not a power
of two); a bfloat16 gradient is widened exactly, then divided in float32. The
sum itself is in the wire's dtype, whatever the backend (gloo and NCCL add in
the dtype they are given). The result goes back into the gradients with one
rounding to their dtype.
"""

from __future__ import annotations

import torch

from commsched.layout.buckets import Bucket

_LOW_PRECISION = frozenset({torch.bfloat16, torch.float16})


def wire_dtype(grad_dtype: torch.dtype, reduce_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype gradients of ``grad_dtype`` are summed in: float32 widens 16-bit gradients,
    bfloat16 or float16 narrows float32 ones; anything else (float64, None) keeps ``grad_dtype``."""
    if reduce_dtype == torch.float32 and grad_dtype in _LOW_PRECISION:
        return torch.float32
    if reduce_dtype in _LOW_PRECISION and grad_dtype == torch.float32:
        return reduce_dtype
    return grad_dtype


def average_onto_wire(bucket: Bucket, world_size: int) -> None:
    """This rank's share of the average, in ``bucket.wire``: the gradients divided by
    ``world_size`` in the wider dtype, cast once."""
    count = bucket.grad_numel
    grads, wire = bucket.flat[:count], bucket.wire[:count]
    if not bucket.cast_on_wire:
        grads.div_(world_size)
    elif wire.element_size() > grads.element_size():
        wire.copy_(grads).div_(world_size)
    else:
        wire.copy_(grads.div_(world_size))


def copy_back(bucket: Bucket, start: int, end: int) -> None:
    """Elements ``start:end`` of the summed ``bucket.wire`` into the gradients (rounded to their dtype).

    Written through ``flat.data``, as a transport's own write: the gradient-touch
    guard counts only the user's writes (see `Bucket.wire`). The flags tail lives
    in the wire and is read there.
    """
    end = min(end, bucket.grad_numel)
    if bucket.cast_on_wire and start < end:
        bucket.flat.data[start:end].copy_(bucket.wire[start:end])
