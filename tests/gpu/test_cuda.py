"""The CPU suite's exactness cases on CUDA: NCCL with one rank per GPU, gloo with CUDA tensors.

Skipped without a GPU (CI has none). On a GPU machine: ``./scripts/test tests/gpu``.
NCCL refuses two ranks on one device, so on a single GPU two ranks use gloo with
CUDA tensors, and NCCL runs one rank (or one per GPU where there are several).
"""

from __future__ import annotations

import pytest
import torch

from commsched.testing import run_ranks
from tests.distributed.test_mixed_precision import mixed_precision_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run ./scripts/test tests/gpu on one)"),
]


def test_nccl_one_rank_matches_one_process():
    run_ranks(mixed_precision_cases, 1, "cuda", backend="nccl", timeout_s=400)


def test_gloo_with_cuda_tensors_two_ranks_on_one_gpu():
    run_ranks(mixed_precision_cases, 2, "cuda", timeout_s=400)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs for two NCCL ranks")
def test_nccl_two_ranks_match_one_process():
    run_ranks(mixed_precision_cases, 2, "cuda", backend="nccl", timeout_s=400)
