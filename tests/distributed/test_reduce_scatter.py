"""Reduce-scattered gradients (``AllReduce(shard_optimizer=True, reduce_scatter=True)``) train
exactly like one process.

Every case compares with single-process training on the concatenated batch,
with 2 and 3 ranks (chunks that split parameters and end in padding), on every
scheduling path, and checks that buckets were reduce-scattered after warm-up
(or, where the loop needs whole gradients, that they were not). Each rank's
``param.grad`` holds the average on its own chunk and NaN elsewhere. Loops
that need the whole gradients are refused after warm-up, with the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest
import torch
import torch.nn.functional as F

import commsched
from commsched.bench.memory import fix_mmap_threshold
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.testing import assert_equal_on_all_ranks, assert_same_parameters, run_subtests
from commsched.watch.guards import GRADIENTS_CHANGED_REASON
from commsched.testing.parity import (
    PARITY_OPTIMIZERS,
    batches,
    case_matches_single_process,
    case_no_sync_accumulation,
    fresh_pair,
    local_step,
    rank_slice,
    reference_backward,
    reference_step,
    uses_aux,
)
from commsched.testing.loops import LOOPS, case as loop_case
from commsched.testing.check_finite import case_skipped_on_every_rank
from commsched.testing.join import batch_counts
from commsched.testing.memory import resident_mib
from commsched.testing.mixed_precision import BFLOAT16_WIRE_ERROR, parameter_error
from commsched.testing.mixed_precision import case as mixed_precision_case
from commsched.testing.reduce_scatter import (
    SCATTERED,
    STRATEGIES,
    assert_scattering,
    reduce_scatter_on_device,
    scattered,
)
from commsched.testing.sharded import case_autotune_switch_points, case_uneven_inputs_under_join
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed


GRID = {
    2: ("default", "one_bucket_per_tensor", "no_priority", "unfused"),
    3: ("small_buckets", "tiny_partitions_and_credit", "no_overlap"),
}
"""The strategies of the parity grid per world size: together, every one of `STRATEGIES`."""


def scattered_buckets(model) -> frozenset[int]:
    """The buckets the model's transport reduce-scatters now."""
    return frozenset(b.index for b in commsched.status(model).buckets if b.averaged is not None)


def case_parity(rank, world_size, optimizer_name, strategy, set_to_none=True):
    """Single-process parameters, with every bucket but the first reduce-scattered after warm-up."""
    model = case_matches_single_process(rank, world_size, optimizer_name, strategy, set_to_none)
    status = commsched.status(model)
    assert scattered_buckets(model) == frozenset(range(len(status.buckets))) - {status.flags_bucket}
    scattered_bytes = sum(status.buckets[b].nbytes for b in scattered_buckets(model))
    if strategy.adaptive is False or strategy.priority is False:  # the cost model keeps its hands off
        assert scattered_bytes > status.buckets[status.flags_bucket].nbytes, status.buckets
    assert "reduce-scatter" in status.transport and status.reduce_scatter_off_reason is None
    commsched.release(model)


def case_gradients_averaged_on_own_chunk(rank, world_size):
    """After a reduce-scattered backward pass and ``synchronize()``, ``param.grad`` holds the
    single-process gradient where this rank owns the bucket, and NaN in the other ranks' chunks
    (never a silently wrong value); the all-reduced first bucket holds it whole."""
    model, optimizer, reference, reference_optimizer = fresh_pair("adam")
    model, optimizer = commsched.prepare(model, optimizer, STRATEGIES["small_buckets"])
    for iteration, (x, y) in enumerate(batches(world_size, 6)):
        F.mse_loss(model(x[rank_slice(rank)], use_aux=uses_aux(iteration, rank)), y[rank_slice(rank)]).backward()
        reference_backward(reference, x, y, iteration, world_size)
        if iteration == 5:
            optimizer.synchronize()
            status, params = commsched.status(model), dict(model.named_parameters())
            checked = nan_seen = 0
            for index, bucket in enumerate(status.buckets):
                low, high = bucket.averaged or (0, sum(params[name].numel() for name in bucket.parameters))
                for name, offset in zip(bucket.parameters, bucket.offsets, strict=True):
                    grad = params[name].grad
                    want = dict(reference.named_parameters())[name].grad
                    if grad is None:
                        assert want is None, name
                        continue
                    got, want = grad.detach().reshape(-1), want.reshape(-1)
                    for element in range(got.numel()):
                        if low <= offset + element < high:
                            torch.testing.assert_close(got[element], want[element], rtol=1e-5, atol=1e-7)
                            checked += 1
                        else:
                            assert index in scattered_buckets(model), (name, element)
                            assert got[element].isnan(), (name, element)
                            nan_seen += 1
            assert checked and nan_seen, (checked, nan_seen)
        optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    assert_same_parameters(model, reference)
    commsched.release(model)


def case_whole_gradients_kept_for_clipping(rank, world_size):
    """``clip_grad_norm_`` from the first iteration: warm-up sees the gradients changed before
    ``step()``, so they stay all-reduced whole (and the norm is the single-process one)."""
    model, optimizer, reference, reference_optimizer = fresh_pair("adamw")
    model, optimizer = commsched.prepare(model, optimizer, STRATEGIES["small_buckets"])
    for iteration, (x, y) in enumerate(batches(world_size, 8)):
        F.mse_loss(model(x[rank_slice(rank)], use_aux=uses_aux(iteration, rank)), y[rank_slice(rank)]).backward()
        optimizer.synchronize()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        optimizer.zero_grad()
        reference_backward(reference, x, y, iteration, world_size)
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        torch.testing.assert_close(norm, want, rtol=1e-5, atol=1e-7)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    assert_same_parameters(model, reference)
    assert not scattered_buckets(model)
    status = commsched.status(model)
    assert "reduce-scatter" not in status.transport
    assert status.reduce_scatter_off_reason == GRADIENTS_CHANGED_REASON
    assert f"reduce-scatter: off ({GRADIENTS_CHANGED_REASON})" in status.describe()
    commsched.release(model)


def case_ranks_decide_alike(rank, world_size):
    """Only rank 0 changes its gradients in place in warm-up (by one: no value changes): every
    rank keeps all-reducing, since the collectives of the two ways differ, and training is exact."""
    model, optimizer, reference, reference_optimizer = fresh_pair("adam")
    model, optimizer = commsched.prepare(model, optimizer, dataclasses.replace(STRATEGIES["small_buckets"],
                                                                               timeout_s=30))
    for iteration, (x, y) in enumerate(batches(world_size, 6)):
        F.mse_loss(model(x[rank_slice(rank)], use_aux=uses_aux(iteration, rank)), y[rank_slice(rank)]).backward()
        if rank == 0 and iteration == 1:
            optimizer.synchronize()
            model.head.weight.grad.mul_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        reference_backward(reference, x, y, iteration, world_size)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    assert_same_parameters(model, reference)
    status = commsched.status(model)
    assert not scattered_buckets(model)
    if rank == 0:
        assert status.reduce_scatter_off_reason == GRADIENTS_CHANGED_REASON
    else:
        assert "another rank's loop changed its gradients" in status.reduce_scatter_off_reason
    commsched.release(model)


def case_refusals_after_warmup(rank, world_size):
    """What needs the whole gradients, first done after warm-up, is refused on every rank, with the fix."""
    with pytest.raises(ValueError, match=r"needs that state sharded: use AllReduce\(shard_optimizer=True, "
                                         r"reduce_scatter=True\)"):
        commsched.AllReduce(reduce_scatter=True)
    with pytest.raises(ValueError, match=r"AllReduce.reduce_scatter must be True or False, got 'yes'"):
        commsched.AllReduce(shard_optimizer=True, reduce_scatter="yes")

    def trained_past_warmup():
        model, optimizer, _, _ = fresh_pair("sgd_nesterov")
        model, optimizer = commsched.prepare(model, optimizer, STRATEGIES["no_overlap"])
        data = list(batches(world_size, 6))
        for iteration, (x, y) in enumerate(data[:4]):
            local_step(model, optimizer, x, y, iteration, rank)
        assert scattered_buckets(model)
        x, y = data[4]
        return model, optimizer, lambda: F.mse_loss(model(x[rank_slice(rank)]), y[rank_slice(rank)])

    model, optimizer, loss = trained_past_warmup()
    loss().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    with pytest.raises(RuntimeError, match=r"gradients were changed between backward\(\) and step\(\).*for the "
                                           r"first time after warm-up.*holds the averaged gradients of its own chunk "
                                           r"only.*Do it from the first iteration on"):
        optimizer.step()
    commsched.release(model)

    left = r"a backward pass began while param.grad still holds the gradients of the last one.*model.no_sync\(\)"
    model, optimizer, loss = trained_past_warmup()
    loss().backward()
    with pytest.raises(RuntimeError, match=left):  # two backward passes, one step
        loss().backward()
    commsched.release(model)
    model, optimizer, loss = trained_past_warmup()
    loss().backward()
    optimizer.step()
    with pytest.raises(RuntimeError, match=left):  # gradients accumulated across steps
        with model.no_sync():
            loss().backward()
    commsched.release(model)

    # Gradients cleared between two backward passes (each way): the second starts afresh, as in one process.
    for clear in (optimizer_zero_grad, model_zero_grad, model_zero_grad_in_place):
        model, optimizer, loss = trained_past_warmup()
        loss().backward()
        clear(model, optimizer)
        loss().backward()
        optimizer.step()
        clear(model, optimizer)
        loss().backward()
        optimizer.step()
        assert_equal_on_all_ranks(model)
        commsched.release(model)


def optimizer_zero_grad(model, optimizer):
    optimizer.zero_grad()


def model_zero_grad(model, optimizer):
    model.zero_grad()


def model_zero_grad_in_place(model, optimizer):
    model.zero_grad(set_to_none=False)


def scattering_prepare(prepared: list):
    """``commsched.prepare`` with this module's default strategy, keeping each model it prepares."""

    def prepare(model, optimizer):
        result = commsched.prepare(model, optimizer, STRATEGIES["default"])
        prepared.append(result[0])
        return result

    return prepare


def case_loop(rank, world_size, loop, optimizer_name="adam", reentrant=None):
    """A loop of test_training_loops (activation checkpointing with ``reentrant``), reduce-scattered."""
    prepared: list = []
    loop_case(world_size, rank, loop, optimizer_name, reentrant, "last", scattering_prepare(prepared))()
    assert_scattering(prepared[0])


def case_grad_scaler_keeps_whole_gradients(rank, world_size, strategy):
    """A ``GradScaler`` from the first iteration: its inf check reads every gradient, so warm-up
    keeps them all-reduced whole; the steps it skips are skipped on every rank."""
    mixed_precision_case(world_size, rank, strategy, "adam_no_decay", "plain")()


def case_autotune(rank, world_size):
    """The auto-tuner's layouts, every one reduce-scattered (its partitions cut across the chunks)."""
    assert_scattering(case_autotune_switch_points(rank, world_size, SCATTERED))


def case_check_finite(rank, world_size):
    """``Strategy(check_finite="skip")``: an inf on one rank skips the step on every rank, in warm-up
    and after it (the verdict rides with the first bucket, which is all-reduced). Each rank names
    only parameters whose average it holds, so the names are not checked."""
    case_skipped_on_every_rank(rank, world_size, "adamw", dataclasses.replace(STRATEGIES["small_buckets"],
                                                                              check_finite="skip"),
                               names_checked=False, check_prepared=assert_scattering)


def case_bfloat16_on_the_wire(rank, world_size):
    """``Strategy(reduce_dtype=torch.bfloat16)``: float32 gradients go on the wire (the all-to-all)
    as bfloat16 and are summed there; the parameters stay within the bfloat16 wire's error of
    one float32 process, and some differ from it."""
    model, optimizer, reference, reference_optimizer = fresh_pair("sgd_nesterov")  # Adam magnifies it 20 times
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    model, optimizer = commsched.prepare(model, optimizer, dataclasses.replace(STRATEGIES["small_buckets"],
                                                                               reduce_dtype=torch.bfloat16))
    for iteration, (x, y) in enumerate(batches(world_size)):
        local_step(model, optimizer, x, y, iteration, rank)
        reference_step(reference, reference_optimizer, x, y, iteration, world_size)
    error = parameter_error(model, reference, initial)
    assert 1e-6 < error < BFLOAT16_WIRE_ERROR, error
    assert_equal_on_all_ranks(model)
    assert_scattering(model)
    buckets = commsched.status(model).buckets
    assert {b.reduce_dtype for b in buckets if b.dtype == "float32"} == {"bfloat16"}, buckets  # float64 keeps its own
    commsched.release(model)


def reduce_scatter_grid(rank: int, world_size: int) -> None:
    cases = {}
    for optimizer_name, label in itertools.product(PARITY_OPTIMIZERS, GRID[world_size]):
        cases[f"single_process/{optimizer_name}/{label}"] = functools.partial(
            case_parity, rank, world_size, optimizer_name, STRATEGIES[label])
    cases["single_process/sgd_nesterov/set_to_none=False"] = functools.partial(
        case_parity, rank, world_size, "sgd_nesterov", STRATEGIES["small_buckets"], False)
    cases["no_sync_accumulation"] = functools.partial(
        case_no_sync_accumulation, rank, world_size, strategy=STRATEGIES["small_buckets"])
    cases["gradients averaged on own chunk"] = functools.partial(case_gradients_averaged_on_own_chunk, rank,
                                                                 world_size)
    cases["whole gradients kept for clipping"] = functools.partial(case_whole_gradients_kept_for_clipping, rank,
                                                                   world_size)
    cases["check_finite"] = functools.partial(case_check_finite, rank, world_size)
    cases["bfloat16 on the wire"] = functools.partial(case_bfloat16_on_the_wire, rank, world_size)
    cases["ranks decide alike"] = functools.partial(case_ranks_decide_alike, rank, world_size)
    cases["refusals after warm-up"] = functools.partial(case_refusals_after_warmup, rank, world_size)
    cases["join/adam/small_buckets"] = functools.partial(
        case_uneven_inputs_under_join, rank, world_size, "adam", STRATEGIES["small_buckets"], batch_counts,
        check_prepared=assert_scattering)
    if world_size == 2:
        for loop in LOOPS[1:]:
            cases[f"loop/{loop}"] = functools.partial(case_loop, rank, world_size, loop)
        for reentrant in (True, False):
            cases[f"loop/{'reentrant' if reentrant else 'non_reentrant'} checkpoint"] = functools.partial(
                case_loop, rank, world_size, "plain", "sgd_momentum", reentrant)
        for label in ("default", "no_overlap"):
            cases[f"GradScaler/{label}"] = functools.partial(case_grad_scaler_keeps_whole_gradients, rank,
                                                             world_size, STRATEGIES[label])
        cases["autotune switch points"] = functools.partial(case_autotune, rank, world_size)
        cases["on the CPU device"] = functools.partial(reduce_scatter_on_device, rank, world_size, "cpu")
    run_subtests(cases)


@pytest.mark.parametrize("world_size", [
    pytest.param(world_size, marks=in_shared_ranks(reduce_scatter_grid, world_size, timeout_s=300))
    for world_size in (2, 3)])
def test_reduce_scatter_grid(shared_ranks, world_size):
    shared_ranks.result()


RECEIVED_WIDTH, RECEIVED_LAYERS = 1024, 8
"""32 MiB of gradients in buckets of about a MiB, all but the first reduce-scattered."""


def resident_after_each_step(rank: int, world_size: int) -> dict | None:
    """The RSS after each iteration's ``synchronize()`` (every reduction done and waited for), from the
    last warm-up iteration, which all-reduces, on; None where glibc's mmap threshold cannot be fixed."""
    if not fix_mmap_threshold():
        return None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, RECEIVED_WIDTH),
                                *[torch.nn.Linear(RECEIVED_WIDTH, RECEIVED_WIDTH) for _ in range(RECEIVED_LAYERS)])
    model, optimizer = commsched.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3),
                                         scattered(adaptive=False))
    inputs, resident = torch.randn(4, 16), []
    for iteration in range(WARMUP_ITERATIONS + 4):
        model(inputs).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        optimizer.synchronize()
        if iteration >= WARMUP_ITERATIONS - 1:
            resident.append(resident_mib())
    assert_scattering(model)
    gradients_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    commsched.release(model)
    return {"resident_mib": resident, "gradients_mib": gradients_mib}


@in_shared_ranks(resident_after_each_step, 2, timeout_s=200)
def test_what_an_all_to_all_received_goes_with_its_reduction(shared_ranks):
    """On gloo each partition's reduce-scatter receives every rank's piece of it, as much as the
    partition, and gloo's work holds it (and what it sent, a copy where a partition is part of a
    chunk) until the work goes. The pass kept every handle, and so every work, until the next pass:
    after a step the RSS was 65 MiB above the last all-reduced iteration's, two copies of the 32 MiB
    of gradients. Now the work goes once this rank's piece is summed ([Note: summed as it arrives]
    in `commsched.comm.reduce_scatter`): within a MiB."""
    results = shared_ranks.result()
    if any(result is None for result in results):
        pytest.skip("needs glibc's mallopt to fix the mmap threshold")
    for result in results:
        all_reduced, *scattered_iterations = result["resident_mib"]
        assert max(scattered_iterations) - all_reduced < result["gradients_mib"] / 2, result
