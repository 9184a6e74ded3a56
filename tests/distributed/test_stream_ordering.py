"""Where the engine orders a GPU's stream instead of waiting on the host, checked on the CPU.

A recording seam (`commsched.testing.seams`) takes a GPU's decisions and logs them while real
gloo collectives run in real processes: each gate orders its buckets' reductions before their
updates, every launch comes after its bucket's mark, nothing makes the host wait between the
forward pass and ``step()`` (only the read of which parameters some rank used, counted in
``commsched.status``), and training stays exact. And ``AllReduce(schedule_one_rank=True)`` runs
the whole schedule on one rank. On a GPU the same paths run with real streams: tests/gpu.
"""

from __future__ import annotations

import re
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import commsched
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.engine.overlap import ONE_REPLICA_REASON
from commsched.testing import assert_equal_on_all_ranks, assert_same_parameters, run_subtests
from commsched.testing.internals import record_updates
from commsched.testing.parity import (
    TINY_CREDIT_MB,
    TINY_PARTITION_MB,
    batches,
    fresh_pair,
    reference_step,
    share_loss,
)
from commsched.testing.reference import OPTIMIZERS, one_process_step, reference_copy
from commsched.testing.seams import RecordingSeam, using_seam
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed

ITERATIONS = WARMUP_ITERATIONS + 4
STEADY = range(WARMUP_ITERATIONS + 1, ITERATIONS)
"""Iterations with forward overlap and the plan, after the one that ends warm-up."""

STRATEGY = commsched.Strategy(bucket_cap_mb=0.002, first_bucket_mb=0.0005, partition_mb=TINY_PARTITION_MB,
                              credit_mb=TINY_CREDIT_MB, adaptive=False)
"""Several buckets, more partitions than buckets, a credit window: launches from completions too."""


class EveryParameterUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor, use_aux: bool = True) -> torch.Tensor:
        return self.body(x)


def train_recorded(rank: int, world_size: int, model: nn.Module, strategy: commsched.Strategy):
    """Train ``model`` beside one process, logging the seam's calls, each update, and where each
    iteration's forward pass, backward pass and ``step()`` begin. Returns (prepared model, log)."""
    reference, reference_optimizer = reference_copy(model, OPTIMIZERS["adamw"])
    log: list[tuple] = []
    with using_seam(lambda device: RecordingSeam(device, log)):
        model, optimizer = commsched.prepare(model, OPTIMIZERS["adamw"](model.parameters()), strategy)
    record_updates(model, [], after=lambda bucket: log.append(("updated", bucket)))
    for iteration, (x, y) in enumerate(batches(world_size, ITERATIONS)):
        log.append(("forward", iteration))
        loss = share_loss(model, x, y, iteration)(rank)
        log.append(("backward", iteration))
        loss.backward()
        log.append(("step", iteration))
        optimizer.step()
        log.append(("stepped", iteration))
        optimizer.zero_grad()
        reference_step(reference, reference_optimizer, x, y, iteration, world_size)
    assert_same_parameters(model, reference)
    assert_equal_on_all_ranks(model)
    return model, log


def window(log: list[tuple], iteration: int, start: str, end: str) -> list[tuple]:
    return log[log.index((start, iteration)):log.index((end, iteration))]


def ordered_bucket(entry: tuple) -> int | None:
    if entry[0] != "order":
        return None
    found = re.fullmatch(r"the reduction of gradient bucket (\d+)", entry[1])
    return None if found is None else int(found.group(1))


def gates_order_before_updating(rank: int, world_size: int) -> None:
    """Each bucket updated at a gate was ordered after its reduction first, in the same gate;
    every launch came after its bucket's mark, some from a completion's thread."""
    torch.manual_seed(0)
    model, log = train_recorded(rank, world_size, EveryParameterUsed(), STRATEGY)
    assert commsched.status(model).overlapping
    for iteration in STEADY:
        forward = window(log, iteration, "forward", "backward")
        updated = [entry[1] for entry in forward if entry[0] == "updated"]
        assert updated, f"iteration {iteration}: no bucket was updated at a gate"
        for bucket in updated:
            at = forward.index(("updated", bucket))
            assert bucket in {ordered_bucket(entry) for entry in forward[:at]}, (
                f"iteration {iteration}: bucket {bucket} was updated before its reduction was ordered: {forward}")
    marks = {entry[1] for entry in log if entry[0] == "mark"}
    launches = [entry for entry in log if entry[0] == "order_after"]
    assert launches and all(entry[1] in marks for entry in launches)
    marked_before = set()
    for entry in log:
        if entry[0] == "mark":
            marked_before.add(entry[1])
        elif entry[0] == "order_after":
            assert entry[1] in marked_before, f"a launch ordered after mark {entry[1]}, made after it"
    threads = {entry[2] for entry in launches}
    assert threading.get_ident() in threads


def no_host_wait_between_forward_and_step(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model, log = train_recorded(rank, world_size, EveryParameterUsed(), STRATEGY)
    for iteration in STEADY:
        host = [entry for entry in window(log, iteration, "forward", "stepped")
                if entry[0] in ("host_read", "wait_all")]
        assert not host, f"iteration {iteration}: the host waited on the device: {host}"
    assert commsched.status(model).previous_iteration.host_waits == 0


def unused_parameters_are_one_counted_read(rank: int, world_size: int) -> None:
    """A model that leaves parameters without gradients reads which some rank used: one host read
    per iteration, counted in ``commsched.status``; the rest is still ordered, and exact."""
    model, _, _, _ = fresh_pair("adamw")
    model, log = train_recorded(rank, world_size, model, STRATEGY)
    for iteration in STEADY:
        reads = [entry for entry in window(log, iteration, "forward", "stepped") if entry[0] == "host_read"]
        assert len(reads) == 1, (iteration, reads)
    status = commsched.status(model)
    assert status.previous_iteration.host_waits == 1
    assert "1 host waits on the device" in status.describe()


def state_read_on_the_host_waits_there(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model, log = train_recorded(rank, world_size, EveryParameterUsed(), STRATEGY)
    log.clear()
    model.state_dict()
    assert ("wait_all",) in log


def recorded_cases(rank: int, world_size: int) -> None:
    run_subtests({
        "gates order their buckets' reductions before updating them": lambda: gates_order_before_updating(
            rank, world_size),
        "no host wait between the forward pass and step()": lambda: no_host_wait_between_forward_and_step(
            rank, world_size),
        "unused parameters are one counted read": lambda: unused_parameters_are_one_counted_read(rank, world_size),
        "state read on the host waits there": lambda: state_read_on_the_host_waits_there(rank, world_size),
    })


@in_shared_ranks(recorded_cases, 2, timeout_s=240)
def test_recorded_stream_ordering(shared_ranks):
    shared_ranks.result()


def one_rank_scheduled(rank: int, world_size: int) -> None:
    """``AllReduce(schedule_one_rank=True)``: partitions go on the wire in the plan, forward overlap
    engages, and one rank trains exactly as one process; without it, nothing is sent."""
    for forced in (True, False):
        torch.manual_seed(0)
        base = EveryParameterUsed()
        reference, reference_optimizer = reference_copy(base, OPTIMIZERS["adamw"])
        strategy = commsched.Strategy(bucket_cap_mb=0.002, first_bucket_mb=0.0005, partition_mb=TINY_PARTITION_MB,
                                      adaptive=False, backend=commsched.AllReduce(schedule_one_rank=forced))
        model, optimizer = commsched.prepare(base, OPTIMIZERS["adamw"](base.parameters()), strategy)
        for iteration, (x, y) in enumerate(batches(1, ITERATIONS)):
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            one_process_step(reference_optimizer, lambda r, x=x, y=y: F.mse_loss(reference(x), y), 1)
        assert_same_parameters(model, reference)
        status = commsched.status(model)
        if forced:
            assert status.overlapping and status.overlap_off_reason is None, status
            assert status.previous_iteration.partitions_issued > len(status.buckets), status
            assert "the whole schedule at one rank" in status.transport, status
            assert "schedule_one_rank=True" in repr(strategy)
        else:
            assert status.overlap_off_reason == ONE_REPLICA_REASON, status
            assert status.partitions == len(status.buckets), "one rank cut its buckets for a wire it does not use"
            assert "the whole schedule" not in status.transport, status
        commsched.release(model)


@in_shared_ranks(one_rank_scheduled, 1, timeout_s=120)
def test_one_rank_runs_the_whole_schedule_when_asked(shared_ranks):
    shared_ranks.result()
