"""All-reduces in two all-to-alls (``AllReduce(all_to_all_mb=...)``, gloo, 3 or more ranks) give
exactly the sum, the same bits on every rank, in any order of completion, and train like one process.

The second steps are issued from completions, on a group of their own, in first-step
order: the random-delay and two-model cases make completions come in different orders on
different ranks, where any other order would pair up the wrong operations and hang or mix
pieces (see [Note: an all-reduce in two steps] in commsched/comm/two_step.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import commsched
from commsched.comm import two_step
from commsched.comm.side_groups import exchange_group_for
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.planning import calibration
from commsched.testing import assert_equal_on_all_ranks, assert_same_parameters, run_subtests
from commsched.testing.parity import (
    TINY_CREDIT_MB,
    TINY_PARTITION_MB,
    batches,
    case_matches_single_process,
    fresh_pair,
    local_step,
    random_delays,
    reference_step,
)
from commsched.testing.sharded import case_uneven_inputs_under_join
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed

EVERY_SIZE = commsched.AllReduce(all_to_all_mb=1024)
"""Every partition in two steps, from the first iteration."""


def two_steps(**fields) -> commsched.Strategy:
    return commsched.Strategy(backend=EVERY_SIZE, **fields)


STRATEGIES = {
    "small_buckets": two_steps(bucket_cap_mb=0.002, first_bucket_mb=0.0005, adaptive=False),
    "tiny_partitions_and_credit": two_steps(bucket_cap_mb=0.004, first_bucket_mb=0.001, partition_mb=TINY_PARTITION_MB,
                                            credit_mb=TINY_CREDIT_MB, adaptive=False, timeout_s=60),
    "no_priority": two_steps(priority=False, bucket_cap_mb=0.002, first_bucket_mb=0.0005),
    "no_overlap": two_steps(overlap_forward=False, bucket_cap_mb=0.002, first_bucket_mb=0.0005, adaptive=False),
    "unfused": two_steps(fuse_optimizer=False, bucket_cap_mb=0.002, first_bucket_mb=0.0005, adaptive=False),
    "cost_model": two_steps(),
    "one_bucket_per_tensor": two_steps(bucket_cap_mb=1e-6, first_bucket_mb=1e-6),
}




@contextlib.contextmanager
def counted_two_steps():
    """How many partitions the transport all-reduces in two steps inside (a list of one count)."""
    count = [0]

    class Counted(two_step.TwoStepAllReduce):
        def __init__(self, *args, **kwargs):
            count[0] += 1
            super().__init__(*args, **kwargs)

    with mock.patch.object(two_step, "TwoStepAllReduce", Counted):
        yield count


def assert_same_on_all_ranks(value: float, what: str) -> None:
    gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor([float(value)], dtype=torch.float64))
    assert len({float(g) for g in gathered}) == 1, f"{what} differs between ranks: {[float(g) for g in gathered]}"


def case_sums_exactly_in_any_order(rank, world_size):
    """Partitions of every size (fewer elements than ranks, uneven pieces) and dtype, all in flight
    at once and waited for in reverse: each is the sum, with the same bits on every rank, and a
    callback attached while in flight runs once it is done."""
    group = dist.group.WORLD
    second_steps = two_step.SecondSteps.of_group(exchange_group_for(group))
    tensors, expected, reductions = [], [], []
    for index, numel in enumerate((1, world_size - 1, world_size, 7, 1000, 4099)):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            per_rank = [torch.randn(numel, generator=torch.Generator().manual_seed(100 * index + r)).to(dtype)
                        for r in range(world_size)]
            tensors.append(per_rank[rank].clone())
            expected.append(torch.stack(per_rank).sum(dim=0))
            reductions.append(two_step.TwoStepAllReduce(tensors[-1], group, second_steps, f"{numel} x {dtype}"))
    called = threading.Event()
    reductions[-1].on_complete(called.set)
    for reduction in reversed(reductions):
        reduction.wait(30)
        assert reduction.is_completed()
    assert called.wait(10), "the completion callback never ran"
    for tensor, want in zip(tensors, expected, strict=True):
        tolerance = {"rtol": 1e-2, "atol": 1e-2} if tensor.dtype == torch.bfloat16 else {}
        torch.testing.assert_close(tensor, want, **tolerance)
        gathered = [torch.empty(tensor.numel(), dtype=torch.float64) for _ in range(world_size)]
        dist.all_gather(gathered, tensor.double())
        assert all(torch.equal(other, tensor.double()) for other in gathered), "ranks hold different sums"


def case_parity(rank, world_size, optimizer_name, strategy):
    """Single-process parameters, with partitions all-reduced in two steps from the first iteration."""
    with counted_two_steps() as count:
        model = case_matches_single_process(rank, world_size, optimizer_name, strategy, True)
    assert count[0] > 0, "nothing was all-reduced in two steps"
    assert "in two all-to-alls" in commsched.status(model).transport
    commsched.release(model)


def case_both_ways_in_one_pass(rank, world_size):
    """Partitions up to 1 KiB in two steps, larger ones by gloo's ring, side by side on the user's
    group in one pass: exact, and both ways were taken."""
    strategy = commsched.Strategy(backend=commsched.AllReduce(all_to_all_mb=1 / 1024), bucket_cap_mb=0.004,
                                  first_bucket_mb=0.0005, adaptive=False)
    with counted_two_steps() as count:
        model = case_matches_single_process(rank, world_size, "adam", strategy, True)
    sizes = [n for bucket in commsched.status(model).buckets for n in bucket.partition_nbytes]
    assert any(n <= 1024 for n in sizes) and any(n > 1024 for n in sizes), sizes
    assert count[0] > 0
    commsched.release(model)


def case_auto_agrees_on_every_rank(rank, world_size):
    """The default times the first bucket's all-reduce both ways at the end of warm-up: every rank
    takes rank 0's verdict, and training is exact whichever it is. Without priority there is no
    warm-up profile, so the ring stays."""
    model = case_matches_single_process(rank, world_size, "adamw", commsched.Strategy(), True)
    limit = commsched.status(model).two_step_max_bytes
    assert limit is not None
    assert_same_on_all_ranks(limit, "the size limit of two-step all-reduces")
    assert "the first bucket" in commsched.status(model).transport, commsched.status(model).transport
    commsched.release(model)
    with counted_two_steps() as count:
        model = case_matches_single_process(rank, world_size, "adamw", commsched.Strategy(priority=False), True)
    assert count[0] == 0 and commsched.status(model).two_step_max_bytes == 0
    commsched.release(model)


def case_auto_sends_only_the_first_bucket_in_two_steps(rank, world_size, share):
    """With two steps timed faster (``share``: what counts as faster, forced here), each pass after
    warm-up sends exactly the partitions of the bucket the forward pass needs first in two
    steps; timed slower, none."""
    strategy = commsched.Strategy(bucket_cap_mb=0.002, first_bucket_mb=0.0005, partition_mb=TINY_PARTITION_MB,
                                  credit_mb=TINY_CREDIT_MB, adaptive=False)
    model, optimizer, reference, reference_optimizer = fresh_pair("adam")
    model, optimizer = commsched.prepare(model, optimizer, strategy)
    with mock.patch.object(calibration, "TWO_STEP_SHARE", share), counted_two_steps() as count:
        for iteration, (x, y) in enumerate(batches(world_size)):
            before = count[0]
            local_step(model, optimizer, x, y, iteration, rank)
            reference_step(reference, reference_optimizer, x, y, iteration, world_size)
            if iteration >= WARMUP_ITERATIONS:
                status = commsched.status(model)
                first = status.buckets[status.flags_bucket].partitions
                assert count[0] - before == (first if share > 1 else 0), (iteration, count[0] - before)
    assert_same_parameters(model, reference)
    status = commsched.status(model).transport
    assert ("the first bucket in two all-to-alls" if share > 1 else "the first bucket by gloo's ring") in status
    commsched.release(model)


def case_two_models_on_one_group(rank, world_size):
    """Two models prepared on one group, trained in turn, share its exchange group: their second
    steps still go in one order on every rank, and both stay exact."""
    pairs = [fresh_pair("adamw"), fresh_pair("sgd_nesterov")]
    prepared = [commsched.prepare(model, optimizer, STRATEGIES["tiny_partitions_and_credit"])
                for model, optimizer, _, _ in pairs]
    for iteration, (x, y) in enumerate(batches(world_size)):
        for (model, optimizer), (_, _, reference, reference_optimizer) in zip(prepared, pairs, strict=True):
            local_step(model, optimizer, x, y, iteration, rank)
            reference_step(reference, reference_optimizer, x, y, iteration, world_size)
    for (model, _), (_, _, reference, _) in zip(prepared, pairs, strict=True):
        assert_same_parameters(model, reference)
        assert_equal_on_all_ranks(model)
        commsched.release(model)


def case_where_two_steps_apply(rank, world_size):
    """gloo among 3 or more ranks, with gradients in host memory."""
    assert two_step.two_steps_possible(dist.group.WORLD, torch.device("cpu"))
    assert not two_step.two_steps_possible(dist.group.WORLD, torch.device("cuda", 0))


def two_step_cases(rank: int, world_size: int) -> None:
    cases = {
        "sums in any order": functools.partial(case_sums_exactly_in_any_order, rank, world_size),
        "both ways in one pass": functools.partial(case_both_ways_in_one_pass, rank, world_size),
        "auto": functools.partial(case_auto_agrees_on_every_rank, rank, world_size),
        "auto, timed faster": functools.partial(case_auto_sends_only_the_first_bucket_in_two_steps, rank,
                                                world_size, 1e9),
        "auto, timed slower": functools.partial(case_auto_sends_only_the_first_bucket_in_two_steps, rank,
                                                world_size, 0.0),
        "two models on one group": functools.partial(case_two_models_on_one_group, rank, world_size),
        "where": functools.partial(case_where_two_steps_apply, rank, world_size),
        "reduce-scattered, first bucket in two steps": functools.partial(
            case_parity, rank, world_size, "adamw", dataclasses.replace(
                STRATEGIES["small_buckets"],
                backend=commsched.AllReduce(shard_optimizer=True, reduce_scatter=True, all_to_all_mb=1024))),
        "uneven inputs under Join": functools.partial(
            case_uneven_inputs_under_join, rank, world_size, "adam", STRATEGIES["tiny_partitions_and_credit"]),
    }
    for index, (name, strategy) in enumerate(STRATEGIES.items()):
        optimizer_name = ("sgd_nesterov", "adamw", "sgd_dampening", "adam")[index % 4]
        cases[f"{name}, {optimizer_name}"] = functools.partial(case_parity, rank, world_size, optimizer_name, strategy)
    run_subtests(cases)


@in_shared_ranks(two_step_cases, 3, timeout_s=300)
def test_two_step_all_reduces_on_three_ranks(shared_ranks):
    shared_ranks.result()


def random_delays_in_two_steps(rank: int, world_size: int) -> None:
    """Each rank's own random compute delays: first steps complete in another order on every rank."""
    run_subtests({
        "random delays": functools.partial(random_delays, rank, world_size, "cpu",
                                           STRATEGIES["tiny_partitions_and_credit"], iterations=24),
        "small buckets": functools.partial(case_parity, rank, world_size, "adam", STRATEGIES["small_buckets"]),
    })


@in_shared_ranks(random_delays_in_two_steps, 4, timeout_s=300)
def test_two_step_all_reduces_with_random_delays_on_four_ranks(shared_ranks):
    shared_ranks.result()


def ring_between_two_ranks(rank: int, world_size: int) -> None:
    """Between 2 ranks a ring takes two steps anyway: no exchange group, gloo's all-reduce throughout."""
    with counted_two_steps() as count:
        model = case_matches_single_process(rank, world_size, "adam", STRATEGIES["small_buckets"], True)
    status = commsched.status(model)
    assert count[0] == 0 and status.two_step_max_bytes is None
    assert status.process_groups.exchange is None
    assert "two all-to-alls" not in commsched.status(model).transport
    commsched.release(model)


@in_shared_ranks(ring_between_two_ranks, 2, timeout_s=120)
def test_two_ranks_keep_the_ring(shared_ranks):
    shared_ranks.result()
