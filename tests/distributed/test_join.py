"""Uneven inputs under torch's ``Join``: the same parameters as torch DDP under ``Join``, no hang."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

import commsched
from commsched.testing import OPTIMIZERS, run_subtests
from commsched.testing.join import batch_counts, batches_of, loss_of, out_during_warmup, train_until_one_rank_is_out
from commsched.testing.models import BatchNormNet, ParityNet
from commsched.testing.servers import prepare_or_serve
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed


def train_under_join(model, optimizer, rank, count, shape, classes):
    with Join([model]):
        for x, y in batches_of(rank, count, shape, classes):
            loss_of(model, x, y, classes).backward()
            optimizer.step()
            optimizer.zero_grad()


def case_same_as_ddp(rank, world_size, strategy, model_kind, counts=batch_counts):
    def case() -> None:
        count = counts(world_size)[rank]
        torch.manual_seed(0)
        if model_kind == "batchnorm":
            model, shape, classes = BatchNormNet(), (1, 6, 6), 3
        else:
            model, shape, classes = ParityNet(), (8,), None
        reference = DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=model_kind == "parity")
        reference_optimizer = OPTIMIZERS["sgd_momentum_no_decay"](reference.parameters())
        optimizer = OPTIMIZERS["sgd_momentum_no_decay"](model.parameters())
        model, optimizer = commsched.prepare(model, optimizer, strategy)
        train_under_join(model, optimizer, rank, count, shape, classes)
        optimizer.synchronize()
        with Join([reference]):
            for x, y in batches_of(rank, count, shape, classes):
                loss_of(reference, x, y, classes).backward()
                reference_optimizer.step()
                reference_optimizer.zero_grad()
        compared = 0
        for (name, got), want in zip(model.state_dict().items(), reference.module.state_dict().values(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
            compared += 1
        assert compared > 0
        commsched.release(model)

    return case


def case_early_termination_raises_everywhere(rank, world_size):
    def case() -> None:
        torch.manual_seed(0)
        model = ParityNet()
        model, optimizer = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
        train_until_one_rank_is_out(model, optimizer, rank, world_size)
        commsched.release(model)

    return case


def uneven_inputs(rank: int, world_size: int) -> None:
    cases = {}
    for label, strategy in (("default", commsched.Strategy()),
                            ("no_overlap", commsched.Strategy(overlap_forward=False)),
                            ("unscheduled", commsched.Strategy(priority=False, partition_mb=None, credit_mb=None,
                                                               overlap_forward=False, fuse_optimizer=False))):
        for model_kind in ("parity", "batchnorm"):
            cases[f"{label} {model_kind}"] = case_same_as_ddp(rank, world_size, strategy, model_kind)
    cases["default parity, out of batches during warm-up"] = case_same_as_ddp(
        rank, world_size, commsched.Strategy(), "parity", out_during_warmup)
    if world_size > 1:  # one rank never runs out before another
        cases["throw_on_early_termination"] = case_early_termination_raises_everywhere(rank, world_size)
    run_subtests(cases)


@pytest.mark.parametrize("world_size", [
    pytest.param(world_size, marks=in_shared_ranks(uneven_inputs, world_size, timeout_s=300)) for world_size in (1, 2, 3)])
def test_uneven_inputs_under_join_match_ddp(shared_ranks, world_size):
    shared_ranks.result()


def join_refused_with_parameter_servers(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = ParityNet()
    prepared = prepare_or_serve(model, torch.optim.SGD(model.parameters(), lr=0.05), num_servers=1)
    if prepared is None:
        return
    model, optimizer = prepared
    for x, y in batches_of(rank, 2, (8,), None):
        loss_of(model, x, y, None).backward()
        optimizer.step()
        optimizer.zero_grad()
    with pytest.raises(RuntimeError, match=r"Join \(uneven inputs\) is not supported with .*ParameterServer"):
        Join([model])
    commsched.release(model)


@in_shared_ranks(join_refused_with_parameter_servers, 3, timeout_s=120)
def test_join_is_refused_with_parameter_servers(shared_ranks):
    shared_ranks.result()
