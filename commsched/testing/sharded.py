"""Sharded optimizer state (``AllReduce(shard_optimizer=True)``): the strategies of its suite and
the cases other suites run again (tests/distributed/test_sharded.py, test_reduce_scatter.py,
test_two_step.py; tests/gpu on CUDA).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools

import torch
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

import commsched
from commsched.testing.join import batch_counts, batches_of, loss_of
from commsched.testing.mixed_precision import case as mixed_precision_case
from commsched.testing.mixed_precision import new_scaler
from commsched.testing.models import ParityNet
from commsched.testing.parity import TINY_CREDIT_MB, TINY_PARTITION_MB, random_delays, train_and_compare
from commsched.testing.reference import OPTIMIZERS
from commsched.testing.subtests import run_subtests


SHARDED = commsched.AllReduce(shard_optimizer=True)


def sharded(**fields) -> commsched.Strategy:
    return commsched.Strategy(backend=SHARDED, **fields)


STRATEGIES = {
    "default": sharded(),
    "small_buckets": sharded(bucket_cap_mb=0.002, first_bucket_mb=0.0005),
    "one_bucket_per_tensor": sharded(bucket_cap_mb=1e-6, first_bucket_mb=1e-6),
    "tiny_partitions_and_credit": sharded(bucket_cap_mb=0.004, first_bucket_mb=0.001, partition_mb=TINY_PARTITION_MB,
                                          credit_mb=TINY_CREDIT_MB, adaptive=False),
    "no_priority": sharded(priority=False, bucket_cap_mb=0.002, first_bucket_mb=0.0005),
    "no_overlap": sharded(overlap_forward=False, bucket_cap_mb=0.002, first_bucket_mb=0.0005),
    "unfused": sharded(fuse_optimizer=False, bucket_cap_mb=0.002, first_bucket_mb=0.0005),
}


def case_autotune_switch_points(rank, world_size, backend=SHARDED):
    """The auto-tuner lays buckets out anew many times: the state is cut anew each time, exactly.
    Returns the model, released."""
    from commsched.testing.autotune import TUNE, assert_tuned_the_same_everywhere, train_in_lockstep

    model, seen = train_in_lockstep(rank, world_size, "plain", optimizer_name="adam",
                                    strategy=dataclasses.replace(TUNE, backend=backend))
    assert_tuned_the_same_everywhere(model, seen)
    commsched.release(model)
    return model


def case_uneven_inputs_under_join(rank, world_size, optimizer_name, strategy, counts=batch_counts, scaler=False,
                                  device="cpu", accumulate=False, check_prepared=None):
    """Uneven inputs under ``Join``: the parameters and the optimizer state of torch DDP under
    ``Join`` (of its rank that trained longest). The learning rate changes at every step, and
    with ``scaler`` an inf in the last iteration, which only rank 0 runs, skips that step:
    ranks out of batches update their chunks with the others' values and verdict
    ([Note: a joined rank's shard]). ``accumulate``: every other batch's backward pass runs
    under ``no_sync()`` and is stepped with the next one's. ``check_prepared``: called with the
    prepared model at the end, before it is released."""
    count = counts(world_size)[rank]
    torch.manual_seed(0)
    model = ParityNet().to(device)
    reference = DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    reference_optimizer = OPTIMIZERS[optimizer_name](reference.parameters())
    model, optimizer = commsched.prepare(model, OPTIMIZERS[optimizer_name](model.parameters()), strategy)
    for net, opt in ((model, optimizer), (reference, reference_optimizer)):
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
        grad_scaler = new_scaler(device) if scaler else None
        with Join([net]):
            for iteration, (x, y) in enumerate(batches_of(rank, count, (8,), None)):
                x, y = x.to(device), y.to(device)
                if scaler and iteration == max(counts(world_size)) - 1:
                    x = x.clone()
                    x[0, 0] = float("inf")
                if accumulate and iteration % 2 == 0:
                    with net.no_sync():
                        loss_of(net, x, y, None).backward()
                    continue
                loss = loss_of(net, x, y, None)
                if grad_scaler is None:
                    loss.backward()
                    opt.step()
                else:
                    grad_scaler.scale(loss).backward()
                    grad_scaler.step(opt)
                    grad_scaler.update()
                opt.zero_grad()
                schedule.step()
    for (name, got), want in zip(model.state_dict().items(), reference.module.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    state = optimizer.state_dict()  # gathered from every rank's chunks (collective)
    if rank == 0:  # the rank that trained longest: under DDP, its state is the one every step made
        want = reference_optimizer.state_dict()
        assert state["param_groups"] == want["param_groups"]
        assert state["state"].keys() == want["state"].keys() and want["state"]
        for index, values in want["state"].items():
            for key, value in values.items():
                torch.testing.assert_close(state["state"][index][key], value, rtol=1e-5, atol=1e-7,
                                           msg=lambda m, i=index, k=key: f"state {i} {k}: {m}")
    if check_prepared is not None:
        check_prepared(model)
    commsched.release(model)


def sharded_on_device(rank: int, world_size: int, device: str) -> None:
    """The cases that take a device (tests/gpu runs them on CUDA): scheduling variants, mixed precision."""
    cases = {}
    for label, optimizer_name in itertools.product(("default", "tiny_partitions_and_credit", "no_overlap"),
                                                   ("sgd_nesterov", "adamw")):
        cases[f"{label}/{optimizer_name}"] = functools.partial(
            train_and_compare, rank, world_size, optimizer_name, STRATEGIES[label], device=device)
    cases["GradScaler"] = mixed_precision_case(world_size, rank, STRATEGIES["default"], "adam_no_decay", "plain",
                                               device)
    cases["bf16 autocast"] = mixed_precision_case(world_size, rank, STRATEGIES["default"], "sgd_momentum",
                                                  "bf16 autocast", device)
    cases["uneven inputs under Join, GradScaler"] = functools.partial(
        case_uneven_inputs_under_join, rank, world_size, "adam_no_decay", STRATEGIES["default"], batch_counts, True,
        device)
    run_subtests(cases)


def sharded_with_random_delays(rank: int, world_size: int, device: str = "cpu") -> None:
    """Each rank's own random compute delays: reductions complete in another order on every rank,
    so the updates (and their all-gathers) started ahead of the gates differ too, unless they
    keep one order; results stay exact and nothing hangs. Then uneven inputs under ``Join`` on
    the same ranks, three of them out of batches at different iterations (the last during warm-up)."""
    strategy = dataclasses.replace(STRATEGIES["tiny_partitions_and_credit"], timeout_s=60)
    scattered = dataclasses.replace(strategy, backend=commsched.AllReduce(shard_optimizer=True, reduce_scatter=True))
    run_subtests({
        "random delays": functools.partial(random_delays, rank, world_size, device, strategy, iterations=24),
        "random delays, reduce-scattered": functools.partial(random_delays, rank, world_size, device, scattered,
                                                             iterations=24),
        "uneven inputs under Join": functools.partial(case_uneven_inputs_under_join, rank, world_size, "adam",
                                                      strategy, device=device),
    })
