"""The cost model's choice at the end of warm-up lays the buckets out anew: results stay exact.

With partitions of 256 bytes on these small models, the cost model always
finds fewer collectives cheaper on loopback (every collective costs at least
one round trip, and every candidate sends the same few kilobytes), so the
layout changes at the first iteration after warm-up, in the middle of training
and of its optimizer state. Every case checks that it did.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

import commsched
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.layout import grad_layout as layout_module
from commsched.planning import calibration as planning
from commsched.planning import cost_model, plans
from commsched.testing import (
    OPTIMIZERS,
    assert_equal_on_all_ranks,
    assert_same_parameters,
    reference_copy,
    run_subtests,
)
from commsched.testing.models import ParityNet
from commsched.tuning import confirmation
from commsched.tuning.controller import SETTLE_ITERATIONS
from commsched.testing.parity import (
    SCHEDULING_OPTIMIZERS,
    TINY_CREDIT_MB,
    TINY_PARTITION_MB,
    batches,
    case_no_sync_accumulation,
    local_step,
    rank_slice,
    reference_step,
    share_loss,
)
from commsched.testing.loops import LOOPS, train
from commsched.testing.models import CheckpointedNet
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed

TINY = commsched.Strategy(partition_mb=TINY_PARTITION_MB, credit_mb=TINY_CREDIT_MB, bucket_cap_mb=0.004,
                          first_bucket_mb=0.001)


def assert_relaid_out(model: torch.nn.Module, rank: int) -> None:
    """The cost model chose fewer collectives than configured, and every rank follows rank 0
    (partitions are then measured against whole buckets; whole buckets are taken at once)."""
    status = commsched.status(model)
    # While the choice is measured, its runner-up may be the configured partitions, on trial.
    on_trial = "measuring it against" in status.partitioning
    assert on_trial or status.partition_mb is None or status.partition_mb > TINY_PARTITION_MB, status.describe()
    expected = ("the cost model's choice: " if rank == 0 else "rank 0's cost model chose ", "the cost model chose ")
    assert status.partitioning.startswith(expected), status.partitioning
    assert sum(b.partitions for b in status.buckets) == status.partitions


def case_partitions_measured_against_whole_buckets(rank, world_size, optimizer_name="adam"):
    """Where the cost model chooses partitions, the next iterations try them and whole buckets in
    turn (every rank the same layout at every iteration), then keep one for good; training stays
    exact across every change. The cost model is made to choose partitions: on loopback it may not."""
    chosen = cost_model.Setting(4 * TINY_PARTITION_MB, 4 * TINY_CREDIT_MB)
    real_choose = plans.choose
    plans.choose = lambda *args, **kwargs: cost_model.Choice(chosen, ())
    try:
        torch.manual_seed(0)
        model = ParityNet()
        reference, reference_optimizer = reference_copy(model, OPTIMIZERS[optimizer_name])
        model, optimizer = commsched.prepare(model, OPTIMIZERS[optimizer_name](model.parameters()), TINY)
        trials = 2 * confirmation.ROUNDS * (SETTLE_ITERATIONS + confirmation.TRIAL_ITERATIONS)  # no runner-up
        used = []
        for iteration, (x, y) in enumerate(batches(world_size, WARMUP_ITERATIONS + trials + 3)):
            local_step(model, optimizer, x, y, iteration, rank)
            reference_step(reference, reference_optimizer, x, y, iteration, world_size)
            used.append(commsched.status(model).partition_mb)
    finally:
        plans.choose = real_choose
    trial = SETTLE_ITERATIONS + confirmation.TRIAL_ITERATIONS
    expected = [chosen.partition_mb, None] * confirmation.ROUNDS
    assert used[WARMUP_ITERATIONS:WARMUP_ITERATIONS + trials:trial] == expected, used
    assert len(set(used[WARMUP_ITERATIONS + trials:])) == 1, used
    status = commsched.status(model)
    assert status.partitioning.startswith(f"the cost model chose {chosen.describe()}"), status.partitioning
    assert "median iteration" in status.partitioning and " ms " in status.partitioning, status.partitioning
    assert_same_parameters(model, reference)
    assert_equal_on_all_ranks(model)
    gathered = [None] * world_size
    torch.distributed.all_gather_object(gathered, used)
    assert all(other == used for other in gathered), gathered


def case_loop(rank, world_size, loop, optimizer="sgd_momentum", reentrant=None, checkpointed="middle",
              strategy=TINY):
    """A training loop of test_training_loops across the change, against one process."""
    torch.manual_seed(0)
    model = CheckpointedNet(reentrant, checkpointed)
    reference, reference_optimizer = reference_copy(model, OPTIMIZERS[optimizer])
    model, optimizer_ = commsched.prepare(model, OPTIMIZERS[optimizer](model.parameters()), strategy)
    got = train(model, optimizer_, loop, world_size, rank)
    assert_relaid_out(model, rank)
    commsched.release(model)
    want = train(reference, reference_optimizer, loop, world_size, None)
    assert want.keys() == got.keys() and want, "nothing to compare"
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def case_unused_parameters(rank, world_size, optimizer_name, strategy, set_to_none):
    """ParityNet (two dtypes, parameters unused on some ranks, one never used) across the change."""
    torch.manual_seed(0)
    model = ParityNet()
    reference, reference_optimizer = reference_copy(model, OPTIMIZERS[optimizer_name])
    model, optimizer = commsched.prepare(model, OPTIMIZERS[optimizer_name](model.parameters()), strategy)
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


def flat_buffers_of_gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    """The flat buffers the model's gradients are views into, each once (``.grad._base``: what a view was cut from)."""
    flats: dict[int, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            assert param.grad._base is not None, f"the gradient of '{name}' is not a view into a bucket"
            flats.setdefault(id(param.grad._base), param.grad._base)
    return list(flats.values())


def case_old_buckets_go_before_new_ones(rank, world_size):
    """Peak memory: with no gradient left in them (``zero_grad(set_to_none=True)``), the old
    buckets are freed before the first new one is made, so the two never coexist while a forward
    pass's activations are alive (they would add a copy of every gradient to the peak). With the
    cyclic garbage collector off: they must go when the last reference does, not at a collection."""
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
    gc.disable()
    try:
        for iteration, (x, y) in enumerate(batches(world_size, WARMUP_ITERATIONS + 2)):
            if iteration == WARMUP_ITERATIONS:  # the change comes at this backward pass's first gradient
                layout_module.Bucket = WatchedBucket
            if iteration != WARMUP_ITERATIONS - 1:
                local_step(model, optimizer, x, y, iteration, rank, set_to_none=True)
                continue
            # The last iteration of warm-up: after its step(), its gradients are views into the flat
            # buffers of the buckets the change replaces (every bucket holds a used parameter).
            share_loss(model, x, y, iteration)(rank).backward()
            optimizer.step()
            old_flats = [weakref.ref(flat) for flat in flat_buffers_of_gradients(model)]
            assert len(old_flats) == len(commsched.status(model).buckets), (len(old_flats), commsched.status(model))
            optimizer.zero_grad(set_to_none=True)
    finally:
        layout_module.Bucket = original
        gc.enable()
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

    measured = []

    def watched_measure_link(*args, **kwargs):
        alive_at_calibration.append(sum(ref() is not None for ref in activations))
        measured.append(measure_link(*args, **kwargs))
        return measured[-1]

    model, optimizer = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), TINY)
    planning.measure_link = watched_measure_link
    try:
        for iteration, (x, y) in enumerate(batches(world_size, WARMUP_ITERATIONS + 2)):
            local_step(model, optimizer, x, y, iteration, rank)
    finally:
        planning.measure_link = measure_link
    assert_relaid_out(model, rank)
    assert alive_at_calibration == [0], alive_at_calibration
    # gloo runs two collectives at once, and the cost model prices its candidates so
    link, _cpu_share = measured[0]
    assert link.in_flight == 2, link
    commsched.release(model)


def case_bucket_sizes_reach_every_rank(rank, world_size):
    """Rank 0's choice of bucket sizes (the first one of its own size, or as large as the others),
    its runner-up and its best whole buckets reach every rank whole, and each is laid out while on trial."""
    chosen = cost_model.Setting(None, None, 0.002, 0.001)
    runner_up = cost_model.Setting(None, None, 0.008)
    best_whole = cost_model.Setting(None, None, 0.002)
    real_choose = plans.choose
    plans.choose = lambda *args, **kwargs: cost_model.Choice(chosen, (), runner_up, best_whole)
    try:
        torch.manual_seed(0)
        model = ParityNet()
        reference, reference_optimizer = reference_copy(model, OPTIMIZERS["adam"])
        model, optimizer = commsched.prepare(model, OPTIMIZERS["adam"](model.parameters()), TINY)
        trials = 4 * confirmation.ROUNDS * (SETTLE_ITERATIONS + confirmation.TRIAL_ITERATIONS)
        used = []
        for iteration, (x, y) in enumerate(batches(world_size, WARMUP_ITERATIONS + trials + 2)):
            local_step(model, optimizer, x, y, iteration, rank)
            reference_step(reference, reference_optimizer, x, y, iteration, world_size)
            status = commsched.status(model)
            used.append((status.partition_mb, status.bucket_cap_mb, status.first_bucket_mb))
    finally:
        plans.choose = real_choose
    trial = SETTLE_ITERATIONS + confirmation.TRIAL_ITERATIONS
    expected = [(None, 0.002, 0.001), (None, 0.008, 0.008), (None, 0.002, 0.002),
                (None, TINY.bucket_cap_mb, TINY.first_bucket_mb)]
    assert used[WARMUP_ITERATIONS:WARMUP_ITERATIONS + trials:trial] == expected * confirmation.ROUNDS, used
    assert_same_parameters(model, reference)
    assert_equal_on_all_ranks(model)
    gathered = [None] * world_size
    torch.distributed.all_gather_object(gathered, used)
    assert all(other == used for other in gathered), gathered


def cases_across_the_change(rank: int, world_size: int) -> None:
    cases = {}
    for loop in LOOPS:
        cases[loop] = functools.partial(case_loop, rank, world_size, loop)
    for reentrant in (True, False):
        for checkpointed in ("middle", "last"):
            kind = "reentrant" if reentrant else "non_reentrant"
            cases[f"{kind} checkpoint of {checkpointed}"] = functools.partial(
                case_loop, rank, world_size, "plain", "sgd_momentum", reentrant, checkpointed)
    cases["penalty before forward with reentrant checkpoints"] = functools.partial(
        case_loop, rank, world_size, "penalty_before_forward", "sgd_momentum", True, "middle")
    cases["adam, no forward overlap"] = functools.partial(
        case_loop, rank, world_size, "plain", "adam", strategy=dataclasses.replace(TINY, overlap_forward=False))
    for optimizer_name in SCHEDULING_OPTIMIZERS:
        for set_to_none in (True, False):
            cases[f"unused parameters, {optimizer_name}, set_to_none={set_to_none}"] = functools.partial(
                case_unused_parameters, rank, world_size, optimizer_name, TINY, set_to_none)
    cases["no_sync accumulation across the change"] = functools.partial(
        case_accumulation_across_the_change, rank, world_size)
    cases["old buckets go before new ones"] = functools.partial(case_old_buckets_go_before_new_ones, rank, world_size)
    cases["link measured without activations"] = functools.partial(
        case_link_measured_without_activations, rank, world_size)
    cases["partitions measured against whole buckets"] = functools.partial(
        case_partitions_measured_against_whole_buckets, rank, world_size)
    cases["bucket sizes reach every rank"] = functools.partial(case_bucket_sizes_reach_every_rank, rank, world_size)
    run_subtests(cases)


@in_shared_ranks(cases_across_the_change, 2, timeout_s=400)
def test_training_is_exact_across_the_cost_models_change(shared_ranks):
    shared_ranks.result()


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


@in_shared_ranks(keeps_configured, 2, timeout_s=120)
def test_adaptive_off_keeps_the_configured_partitions(shared_ranks):
    texts = shared_ranks.result()
    assert len(texts) == 2
    for text in texts:
        assert text.startswith("as configured"), text
