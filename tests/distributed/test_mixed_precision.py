"""Mixed precision: ``torch.amp.GradScaler`` and bf16 autocast train exactly like one process.

The scaler's steps are checked where they matter: a step skipped on an inf/NaN
(the first one, while momentum buffers do not exist yet, and later ones), the
scale it backs off and grows again, an explicit ``scaler.unscale_`` before
clipping, for every update path (fused per bucket, per bucket with the param
group's own kernel, the user's optimizer stepping itself with and without its
own scaling support). Infs come from the data, so one process sees them too.
``tests/gpu/`` runs the same cases on CUDA.

``Strategy(reduce_dtype=...)``: 16-bit parameters summed in float32 and float32
parameters sent as bfloat16, against one process whose gradients are summed the
same way (`reduce_like_strategy`), through every scheduling path, ``no_sync``,
a ``GradScaler`` and unused parameters; bfloat16 on the wire also against one
float32 process. ``tests/gpu/`` runs these cases on CUDA too (on one rank, where
nothing is summed, against one process reducing nothing).
"""

from __future__ import annotations

import copy

import pytest
import torch

import commsched
from commsched.testing.mixed_precision import (
    SUMMED_IN_FLOAT32,
    backward_of_share,
    mixed_precision_cases,
    parity_net,
    reduce_dtype_cases,
    reduce_like_strategy,
)
from commsched.testing.parity import batches
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed


@in_shared_ranks(mixed_precision_cases, 2, timeout_s=400)
def test_mixed_precision_matches_one_process(shared_ranks):
    shared_ranks.result()


@in_shared_ranks(mixed_precision_cases, 1, timeout_s=400)
def test_mixed_precision_one_rank(shared_ranks):
    """The cases tests/gpu runs on one NCCL rank, here on CPU."""
    shared_ranks.result()


# ------------------------------------------------------------------------------ reduce_dtype


@in_shared_ranks(reduce_dtype_cases, 2, timeout_s=240)
def test_reduce_dtype_matches_one_process_reducing_alike(shared_ranks):
    shared_ranks.result()


@in_shared_ranks(reduce_dtype_cases, 1, timeout_s=240)
def test_reduce_dtype_one_rank(shared_ranks):
    """The cases tests/gpu runs on one NCCL rank, here on CPU: one replica sums nothing."""
    shared_ranks.result()


def float32_sum_on_three_ranks(rank: int, world_size: int) -> None:
    """From three ranks on, summing bfloat16 gradients in float32 changes their values (a division
    by 3, two additions, each rounded in bfloat16 otherwise). gloo adds three ranks' float32
    values in an order of its own, which moves the float32 sum by an ulp and, rarely, its
    rounding to bfloat16: so the gradients are the float32 emulation's on all but a few
    elements (within one bfloat16 ulp there), and the bfloat16 emulation's on far fewer."""
    model = parity_net(torch.bfloat16)
    summed_in_float32, summed_in_bfloat16 = copy.deepcopy(model), copy.deepcopy(model)
    model, _ = commsched.prepare(model, None, commsched.Strategy(reduce_dtype=torch.float32))
    try:
        x, y = next(batches(world_size, 1))
        backward_of_share(model, x, y, 0, rank)
        for emulated, wire in ((summed_in_float32, SUMMED_IN_FLOAT32), (summed_in_bfloat16, {})):
            reduce_like_strategy(emulated, lambda r, e=emulated: backward_of_share(e, x, y, 0, r), world_size, wire)
        differ = {"float32": 0, "bfloat16": 0}
        elements = 0
        for (name, p), f, b in zip(model.named_parameters(), summed_in_float32.parameters(),
                                   summed_in_bfloat16.parameters(), strict=True):
            if p.grad is None or p.dtype != torch.bfloat16:
                continue
            ulp = torch.finfo(torch.bfloat16).eps * f.grad.float().abs()
            assert ((p.grad.float() - f.grad.float()).abs() <= ulp).all(), f"'{name}': not summed in float32"
            differ["float32"] += int((p.grad != f.grad).sum())
            differ["bfloat16"] += int((p.grad != b.grad).sum())
            elements += p.numel()
        assert elements > 0
        assert differ["float32"] <= elements // 100 and differ["bfloat16"] >= 10 * max(1, differ["float32"]), (
            f"of {elements} elements, {differ} differ from the emulation summing in that dtype")
    finally:
        commsched.release(model)


@in_shared_ranks(float32_sum_on_three_ranks, 3, timeout_s=120)
def test_reduce_dtype_float32_changes_the_sum_of_three_ranks(shared_ranks):
    shared_ranks.result()
