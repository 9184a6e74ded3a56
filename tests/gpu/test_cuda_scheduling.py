"""fp32 on CUDA: every scheduling variant keeps single-process results, overlap engages, a stalled peer times out.

Skipped without a GPU (CI has none). On a GPU machine: ``./scripts/test tests/gpu``.
Two ranks share one GPU over gloo with CUDA tensors (NCCL refuses two ranks on
one device); one rank runs on NCCL. The CPU suite's grids run here with their
tensors on the GPU.
"""

from __future__ import annotations

import logging

import pytest
import torch

import commsched
from commsched.engine.overlap import ONE_REPLICA_REASON
from commsched.testing import run_ranks, run_subtests
from commsched.testing.hung_peers import HANG_POINTS, hung_peer
from commsched.testing.parity import random_delays, train_and_compare
from commsched.testing.scheduling import ITERATIONS, collected_logs, scheduling_grid

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run ./scripts/test tests/gpu on one)"),
]


def overlap_engages(rank: int, world_size: int, device: str) -> None:
    """The default strategy on CUDA overlaps (one replica has nothing to overlap): no false
    "gradients modified" verdict.

    gloo writes a CUDA tensor's result back with an in-place copy; the guard must
    not take that for the user's write (see ``Bucket.wire``).
    """
    with collected_logs() as records:
        model = train_and_compare(rank, world_size, "sgd_nesterov", commsched.Strategy(), iterations=ITERATIONS + 4,
                                  device=device)
    warnings = [record.getMessage() for record in records if record.levelno >= logging.WARNING]
    status = commsched.status(model)
    if world_size == 1:
        assert status.overlap_off_reason == ONE_REPLICA_REASON, status
    else:
        assert status.overlap_off_reason is None and status.overlapping, status
    assert not warnings, warnings


def cuda_grid(rank: int, world_size: int, device: str) -> None:
    run_subtests({
        "every scheduling variant and optimizer": lambda: scheduling_grid(rank, world_size, device),
        "overlap engages": lambda: overlap_engages(rank, world_size, device),
    })


def test_gloo_with_cuda_tensors_every_variant_matches_one_process():
    run_ranks(cuda_grid, 2, "cuda", timeout_s=600)


def test_nccl_one_rank_every_variant_matches_one_process():
    run_ranks(cuda_grid, 1, "cuda", backend="nccl", timeout_s=600)


def test_gloo_with_cuda_tensors_slow_ranks_keep_gates_exact():
    """Random delays per rank: reductions still in flight at the next forward pass, whose gates
    must wait for them (a forward that ran on last step's weights would not match)."""
    run_ranks(random_delays, 2, "cuda", timeout_s=400)


def test_gloo_with_cuda_tensors_stalled_peer_times_out():
    elapsed, _ = run_ranks(hung_peer, 2, 1, "cuda", timeout_s=120)
    assert 1.5 <= elapsed < 7.0, f"rank 0 gave up after {elapsed:.1f} s, expected about 2 s ({HANG_POINTS[1]})"
