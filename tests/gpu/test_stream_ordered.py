"""Stream-ordered waits on a GPU: exact under lag, and no host wait inside an iteration.

Skipped without a GPU (CI has none). On a GPU machine: ``./scripts/test tests/gpu``.
NCCL runs one rank with ``AllReduce(schedule_one_rank=True)``, so every bucket really goes
through NCCL and every gate orders the stream; gloo runs two ranks with CUDA tensors. Before
each backward pass a kernel that only spins (``torch.cuda._sleep``) keeps the GPU behind the
host, so a wait that does not order the stream, or a launch that reads a bucket before its
gradients, shows as a wrong parameter. See [Note: stream-ordered waits] in commsched/device.py;
the same decisions are checked without a GPU in tests/distributed/test_stream_ordering.py.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import commsched
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.testing import run_ranks, run_subtests
from commsched.testing.parity import SCHEDULING_OPTIMIZERS, TINY_CREDIT_MB, TINY_PARTITION_MB, train_and_compare

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run ./scripts/test tests/gpu on one)"),
]

LAG_CYCLES = 20_000_000
"""A spinning kernel of about 10 ms before each backward pass: the host runs ahead of the GPU."""


def variants(forced: bool, world_size: int) -> dict[str, commsched.Strategy]:
    def backend(**fields) -> commsched.AllReduce:
        return commsched.AllReduce(schedule_one_rank=forced, **fields)

    small = {"bucket_cap_mb": 0.004, "first_bucket_mb": 0.001, "adaptive": False}
    found = {
        "default": commsched.Strategy(backend=backend()),
        "partitions and credit": commsched.Strategy(partition_mb=TINY_PARTITION_MB, credit_mb=TINY_CREDIT_MB,
                                                    backend=backend(), **small),
        "whole buckets, no credit": commsched.Strategy(partition_mb=None, credit_mb=None, backend=backend(), **small),
        "overlap off": commsched.Strategy(overlap_forward=False, backend=backend(), **small),
        "sharded": commsched.Strategy(backend=backend(shard_optimizer=True), **small),
        "check_finite": commsched.Strategy(check_finite="skip", backend=backend(), **small),
    }
    if world_size > 1:
        found["sharded, reduce-scatter"] = commsched.Strategy(
            backend=backend(shard_optimizer=True, reduce_scatter=True), **small)
    return found


def lagging(model: nn.Module) -> None:
    """After each forward pass, before its backward: a kernel that keeps the GPU behind the host."""
    model.register_forward_hook(lambda module, args, output: torch.cuda._sleep(LAG_CYCLES))


def exact_under_lag(rank: int, world_size: int, optimizer_name: str, name: str, strategy: commsched.Strategy,
                    forced: bool) -> None:
    model = train_and_compare(rank, world_size, optimizer_name, strategy, device="cuda", before_prepare=lagging,
                              delays=lambda iteration: torch.cuda._sleep(LAG_CYCLES))
    status = commsched.status(model)
    if strategy.overlap_forward and (forced or world_size > 1):
        assert status.overlapping, (name, status)
    if name == "partitions and credit":
        assert status.previous_iteration.partitions_issued > len(status.buckets), status
    commsched.release(model)


def stream_ordered_grid(rank: int, world_size: int, forced: bool) -> None:
    cases = {}
    for (name, strategy), optimizer_name in itertools.product(variants(forced, world_size).items(),
                                                              SCHEDULING_OPTIMIZERS):
        cases[f"{optimizer_name}/{name}"] = functools.partial(
            exact_under_lag, rank, world_size, optimizer_name, name, strategy, forced)
    run_subtests(cases)


def test_nccl_one_rank_scheduled_every_variant_matches_one_process_under_lag():
    run_ranks(stream_ordered_grid, 1, True, backend="nccl", timeout_s=600)


def test_gloo_with_cuda_tensors_every_variant_matches_one_process_under_lag():
    run_ranks(stream_ordered_grid, 2, False, timeout_s=600)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def no_host_sync_in_steady_iterations(rank: int, world_size: int) -> str:
    """``torch.cuda.set_sync_debug_mode("error")`` around iterations after warm-up: nothing commsched
    does there synchronises the host with the GPU (inputs are made on the GPU, no loss is read)."""
    torch.manual_seed(0)
    model = Mlp().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    strategy = commsched.Strategy(backend=commsched.AllReduce(schedule_one_rank=True), adaptive=False)
    model, optimizer = commsched.prepare(model, optimizer, strategy)
    checked = range(WARMUP_ITERATIONS + 2, WARMUP_ITERATIONS + 8)
    for iteration in range(WARMUP_ITERATIONS + 8):
        x = torch.randn(64, 256, device="cuda")
        y = torch.randint(0, 10, (64,), device="cuda")
        if iteration == checked.start:
            torch.cuda.set_sync_debug_mode("error")
        try:
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        finally:
            if iteration == checked.stop - 1:
                torch.cuda.set_sync_debug_mode(0)
    status = commsched.status(model)
    assert status.overlapping and status.previous_iteration.host_waits == 0, status
    commsched.release(model)
    return "no sync"


def test_nccl_one_rank_scheduled_iterations_never_synchronise_the_host():
    assert run_ranks(no_host_sync_in_steady_iterations, 1, backend="nccl", timeout_s=300) == ["no sync"]
