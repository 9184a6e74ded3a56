"""The CPU suite's exactness cases on CUDA: NCCL with one rank per GPU, gloo with CUDA tensors.

Mixed precision, ``Strategy(check_finite=...)``, ``Strategy(reduce_dtype=...)`` and sharded
optimizer state.

Skipped without a GPU (CI has none). On a GPU machine: ``./scripts/test tests/gpu``.
NCCL refuses two ranks on one device, so on a single GPU two ranks use gloo with
CUDA tensors, and NCCL runs one rank (or one per GPU where there are several).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import commsched
from commsched.testing import run_ranks
from commsched.testing.check_finite import check_finite
from commsched.testing.ddp_scripts import case_drop_in
from commsched.testing.mixed_precision import mixed_precision_cases, reduce_dtype_cases
from commsched.testing.models import BatchNormNet
from commsched.testing.reduce_scatter import reduce_scatter_on_device
from commsched.testing.sharded import sharded_on_device, sharded_with_random_delays

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


def nccl_models_share_side_groups(rank: int, world_size: int) -> str:
    """On NCCL, the control messages need a gloo side group: a second model on the same group, or
    on a sub-group, must share it (torch names a locally synchronised group by its ranks alone,
    so making a second one would wait forever)."""
    for group in (None, dist.new_group(list(range(world_size)))):
        made = []
        for _ in range(2):
            base = BatchNormNet().cuda()
            model, optimizer = commsched.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1),
                                                 process_group=group)
            made.append(commsched.status(model).process_groups.control)
            for _ in range(5):
                x = torch.randn(4, 1, 6, 6, device="cuda")
                F.cross_entropy(model(x), torch.zeros(4, dtype=torch.long, device="cuda")).backward()
                optimizer.step()
                optimizer.zero_grad()
            commsched.release(model)
        assert made[0] is made[1], "a second model made a second side group"
        assert dist.get_backend(made[0]) == "cpu:gloo,cuda:nccl"
    return "trained"


def test_nccl_models_share_one_side_group_per_group():
    assert run_ranks(nccl_models_share_side_groups, 1, backend="nccl", timeout_s=300) == ["trained"]


def test_check_finite_nccl_one_rank():
    """One rank's inf skips the step; the verdict reaches the host through pinned memory and an event."""
    run_ranks(check_finite, 1, "cuda", backend="nccl", timeout_s=240)


def test_check_finite_gloo_with_cuda_tensors_two_ranks():
    """As on one rank, with forward overlap: the second inf comes with updates pending at the gates."""
    run_ranks(check_finite, 2, "cuda", timeout_s=240)


def test_reduce_dtype_nccl_one_rank():
    """One replica sums nothing: ``reduce_dtype`` changes no gradient."""
    run_ranks(reduce_dtype_cases, 1, "cuda", backend="nccl", timeout_s=240)


def test_reduce_dtype_gloo_with_cuda_tensors_two_ranks():
    """The casts onto the wire and back on the GPU, the sum (gloo's) on the host."""
    run_ranks(reduce_dtype_cases, 2, "cuda", timeout_s=240)


def drop_in_on_cuda(rank: int, world_size: int) -> None:
    case_drop_in(rank, "cuda")


def test_ddp_drop_in_gloo_with_cuda_tensors_two_ranks():
    """commsched.DistributedDataParallel(device_ids=[0]) against torch DDP on the same GPU: inputs
    made on the host are moved by the wrapper, the adopted optimizer updates on the GPU."""
    run_ranks(drop_in_on_cuda, 2, timeout_s=240)


def test_sharded_state_nccl_one_rank():
    run_ranks(sharded_on_device, 1, "cuda", backend="nccl", timeout_s=300)


def test_sharded_state_gloo_with_cuda_tensors_two_ranks():
    """The all-gathers of updated parameters and of the state, on CUDA tensors, with skewed ranks."""
    run_ranks(sharded_on_device, 2, "cuda", timeout_s=300)
    run_ranks(sharded_with_random_delays, 2, "cuda", timeout_s=300)


def test_reduce_scatter_gloo_with_cuda_tensors_two_ranks():
    """Reduce-scattered gradients (gloo's all-to-all on CUDA tensors), the NaN fill and the update
    of each rank's chunk on the device, with ``Join``."""
    run_ranks(reduce_scatter_on_device, 2, "cuda", timeout_s=300)
