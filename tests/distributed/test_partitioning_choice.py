"""The cost model's choice at the end of warm-up lays the buckets out anew: results stay exact.

With partitions of 256 bytes on these small models, the cost model always
finds fewer collectives cheaper on loopback (every collective costs at least
one round trip, and every candidate sends the same few kilobytes), so the
layout changes at the first iteration after warm-up, in the middle of training
and of its optimizer state. Every case checks that it did.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import weakref

import pytest
import torch
import torch.nn.functional as F

import commsched
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.layout import grad_layout as layout_module
from commsched.planning import calibration as planning
from commsched.testing import run_ranks, run_subtests
from commsched.testing.models import ParityNet
from tests.distributed.test_allreduce_parity import (
    assert_equal_on_all_ranks,
    assert_same_parameters,
    batches,
    case_no_sync_accumulation,
    local_step,
    rank_slice,
    reference_step,
)
from tests.distributed.test_scheduling import OPTIMIZERS as PARITY_OPTIMIZERS
from tests.distributed.test_scheduling import TINY_CREDIT_MB, TINY_PARTITION_MB
from tests.distributed.test_training_loops import LOOPS, OPTIMIZERS, CheckpointedNet, train

pytestmark = pytest.mark.distributed

TINY = commsched.Strategy(partition_mb=TINY_PARTITION_MB, credit_mb=TINY_CREDIT_MB, bucket_cap_mb=0.004,
                          first_bucket_mb=0.001)


def assert_relaid_out(model: torch.nn.Module, rank: int) -> None:
    """The cost model chose fewer collectives than configured, and every rank follows rank 0."""
    status = commsched.status(model)
    assert status.partition_mb is None or status.partition_mb > TINY_PARTITION_MB, status.describe()
    expected = "the cost model's choice: " if rank == 0 else "rank 0's cost model chose "
    assert status.partitioning.startswith(expected), status.partitioning
    assert sum(b.partitions for b in status.buckets) == status.partitions


def case_loop(rank, world_size, loop, optimizer="sgd", reentrant=None, checkpointed="middle", strategy=TINY):
    """A training loop of test_training_loops across the change, against one process."""
    torch.manual_seed(0)
    model = CheckpointedNet(reentrant, checkpointed)
    reference = copy.deepcopy(model)
    optimizer_ = OPTIMIZERS[optimizer](model.parameters())
    reference_optimizer = OPTIMIZERS[optimizer](reference.parameters())
    model, optimizer_ = commsched.prepare(model, optimizer_, strategy)
    got = train(model, optimizer_, loop, world_size, rank)
    assert_relaid_out(model, rank)
    commsched.release(model)
    want = train(reference, reference_optimizer, loop, world_size, None)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def case_unused_parameters(rank, world_size, optimizer_name, strategy, set_to_none):
    """ParityNet (two dtypes, parameters unused on some ranks, one never used) across the change."""
    torch.manual_seed(0)
    model = ParityNet()
    reference = copy.deepcopy(model)
    optimizer = PARITY_OPTIMIZERS[optimizer_name](model.parameters())
    reference_optimizer = PARITY_OPTIMIZERS[optimizer_name](reference.parameters())
    model, optimizer = commsched.prepare(model, optimizer, strategy)
    partitions_in_warmup = None
    for iteration, (x, y) in enumerate(batches(world_size, WARMUP_ITERATIONS + 4)):
        local_step(model, optimizer, x, y, iteration, rank, set_to_none)
        reference_step(reference, reference_optimizer, x, y, iteration, world_size, set_to_none)
        if iteration == WARMUP_ITERATIONS - 1:
            partitions_in_warmup = commsched.status(model).partitions
    assert commsched.status(model).partitions < partitions_in_warmup
    assert_relaid_out(model, rank)
    assert_same_parameters(model, reference)
    assert_equal_on_all_ranks(model)


def case_accumulation_across_the_change(rank, world_size, micro_steps=2):
    """Gradients accumulated under no_sync in the old buckets move into the new ones."""
    model = case_no_sync_accumulation(rank, world_size, micro_steps, steps=WARMUP_ITERATIONS + 2, strategy=TINY)
    assert_relaid_out(model, rank)


def case_old_buckets_go_before_new_ones(rank, world_size):
    """Peak memory: with no gradient left in them (``zero_grad(set_to_none=True)``), the old
    buckets are freed before the first new one is made, so the two never coexist while a forward
    pass's activations are alive (they would add a copy of every gradient to the peak)."""
    torch.manual_seed(0)
    model = ParityNet()
    model, optimizer = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), TINY)
    old_flats: list[weakref.ref] = []
    old_alive_at_each_new_bucket: list[int] = []

    class WatchedBucket(layout_module.Bucket):
        def __init__(self, *args, **kwargs):
            old_alive_at_each_new_bucket.append(sum(ref() is not None for ref in old_flats))
            super().__init__(*args, **kwargs)

    original = layout_module.Bucket
    try:
        for iteration, (x, y) in enumerate(batches(world_size, WARMUP_ITERATIONS + 2)):
            if iteration == WARMUP_ITERATIONS:  # the change comes at this backward pass's first gradient
                old_flats = [weakref.ref(bucket.flat) for bucket in model._commsched_reducer.layout.buckets]
                layout_module.Bucket = WatchedBucket
            local_step(model, optimizer, x, y, iteration, rank, set_to_none=True)
    finally:
        layout_module.Bucket = original
    assert_relaid_out(model, rank)
    assert old_flats and old_alive_at_each_new_bucket, "the layout did not change"
    assert max(old_alive_at_each_new_bucket) == 0, (
        f"old buckets alive while new ones were made: {old_alive_at_each_new_bucket} of {len(old_flats)}")
    commsched.release(model)


def case_link_measured_without_activations(rank, world_size):
    """Peak memory: the cost model's calibration (all-reduces of up to 8 MiB) runs when no
    forward pass's activations are alive. At the first gradient of the next backward pass,
    as it once did, every activation was, and the calibration added to the peak."""
    torch.manual_seed(0)
    model = ParityNet()
    activations: list[weakref.ref] = []
    alive_at_calibration: list[int] = []
    # A Tanh output: saved for the backward pass, by the Tanh and by the next Linear.
    model.blocks[1].register_forward_hook(lambda module, args, output: activations.append(weakref.ref(output)))
    measure_link = planning.measure_link

    def watched_measure_link(*args, **kwargs):
        alive_at_calibration.append(sum(ref() is not None for ref in activations))
        return measure_link(*args, **kwargs)

    model, optimizer = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), TINY)
    planning.measure_link = watched_measure_link
    try:
        for iteration, (x, y) in enumerate(batches(world_size, WARMUP_ITERATIONS + 2)):
            local_step(model, optimizer, x, y, iteration, rank)
    finally:
        planning.measure_link = measure_link
    assert_relaid_out(model, rank)
    assert alive_at_calibration == [0], alive_at_calibration
    commsched.release(model)


def cases_across_the_change(rank: int, world_size: int) -> None:
    cases = {}
    for loop in LOOPS:
        cases[loop] = functools.partial(case_loop, rank, world_size, loop)
    for reentrant in (True, False):
        for checkpointed in ("middle", "last"):
            kind = "reentrant" if reentrant else "non_reentrant"
            cases[f"{kind} checkpoint of {checkpointed}"] = functools.partial(
                case_loop, rank, world_size, "plain", "sgd", reentrant, checkpointed)
    cases["penalty before forward with reentrant checkpoints"] = functools.partial(
        case_loop, rank, world_size, "penalty_before_forward", "sgd", True, "middle")
    cases["adam, no forward overlap"] = functools.partial(
        case_loop, rank, world_size, "plain", "adam", strategy=dataclasses.replace(TINY, overlap_forward=False))
    for optimizer_name in PARITY_OPTIMIZERS:
        for set_to_none in (True, False):
            cases[f"unused parameters, {optimizer_name}, set_to_none={set_to_none}"] = functools.partial(
                case_unused_parameters, rank, world_size, optimizer_name, TINY, set_to_none)
    cases["no_sync accumulation across the change"] = functools.partial(
        case_accumulation_across_the_change, rank, world_size)
    cases["old buckets go before new ones"] = functools.partial(case_old_buckets_go_before_new_ones, rank, world_size)
    cases["link measured without activations"] = functools.partial(
        case_link_measured_without_activations, rank, world_size)
    run_subtests(cases)


def test_training_is_exact_across_the_cost_models_change():
    run_ranks(cases_across_the_change, 2, timeout_s=400)


def keeps_configured(rank: int, world_size: int) -> str:
    """adaptive=False: the partitions stay as configured, and status says so."""
    model = ParityNet()
    model, optimizer = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01),
                                         dataclasses.replace(TINY, adaptive=False))
    for iteration, (x, y) in enumerate(batches(world_size, WARMUP_ITERATIONS + 2)):
        F.mse_loss(model(x[rank_slice(rank)]), y[rank_slice(rank)]).backward()
        optimizer.step()
        optimizer.zero_grad()
    status = commsched.status(model)
    assert status.partition_mb == TINY_PARTITION_MB and status.credit_mb == TINY_CREDIT_MB
    return status.partitioning


def test_adaptive_off_keeps_the_configured_partitions():
    for text in run_ranks(keeps_configured, 2, timeout_s=120):
        assert text.startswith("as configured"), text
