"""State read through any module is current, whatever the loop changes around ``step()``.

With forward overlap, ``step()`` returns before its updates are applied. Each
case reads or changes state the way training scripts do (a tensor learning
rate an LR scheduler changes in place, a backbone's ``state_dict()`` saved
alone, a head loaded alone, a parameter-free module added, BatchNorm
statistics under gradient accumulation) and compares with one process on the
concatenated batch, or with torch DDP where the semantics are DDP's; or checks
that what cannot work (a model converted after ``prepare()``) is refused.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import ExponentialLR

import commsched
from commsched.engine.lifecycle import WARMUP_ITERATIONS, Lifecycle
from commsched.testing import assert_same_parameters, reference_copy, run_subtests
from commsched.testing.models import BatchNormNet, ParityNet
from commsched.testing.parity import batches, local_step, rank_slice, reference_step
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed

ITERATIONS = 8
"""Past warm-up, so that updates are pending when ``step()`` returns."""

TENSOR_LR_OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=torch.tensor(0.1), momentum=0.9, weight_decay=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(0.02), betas=(torch.tensor(0.9), torch.tensor(0.99))),
}


def prepared_pair(make_optimizer, strategy=None):
    torch.manual_seed(0)
    model = ParityNet()
    reference, reference_optimizer = reference_copy(model, make_optimizer)
    model, optimizer = commsched.prepare(model, make_optimizer(model.parameters()), strategy)
    return model, optimizer, reference, reference_optimizer


def case_tensor_learning_rate_under_a_scheduler(rank, world_size, optimizer_name):
    """The scheduler changes the tensor in place after step(): the pending update keeps step()'s value."""
    make_optimizer = TENSOR_LR_OPTIMIZERS[optimizer_name]
    model, optimizer, reference, reference_optimizer = prepared_pair(make_optimizer)
    scheduler, reference_scheduler = ExponentialLR(optimizer, 0.5), ExponentialLR(reference_optimizer, 0.5)
    for iteration, (x, y) in enumerate(batches(world_size, ITERATIONS)):
        local_step(model, optimizer, x, y, iteration, rank)
        scheduler.step()
        reference_step(reference, reference_optimizer, x, y, iteration, world_size)
        reference_scheduler.step()
    assert commsched.status(model).lifecycle is Lifecycle.OVERLAPPING, "the case needs updates pending after step()"
    assert_same_parameters(model, reference, rtol=1e-5, atol=1e-6)


def assert_same_state(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys() and actual, f"{what}: keys {list(actual)} != {list(expected)}"
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{what} '{k}': {m}")


def case_submodule_state_dict_right_after_step(rank, world_size):
    """A backbone or a head saved alone holds the parameters step() made.

    Read once, after the last step: reads the warm-up saw would be served at step() anyway."""
    model, optimizer, reference, reference_optimizer = prepared_pair(functools.partial(torch.optim.SGD, lr=0.1))
    for iteration, (x, y) in enumerate(batches(world_size, ITERATIONS)):
        local_step(model, optimizer, x, y, iteration, rank)
        reference_step(reference, reference_optimizer, x, y, iteration, world_size)
    assert commsched.status(model).lifecycle is Lifecycle.OVERLAPPING, "the case needs updates pending after step()"
    assert_same_state(model.blocks[2].state_dict(), reference.blocks[2].state_dict(), "blocks.2 after the last step")
    assert_same_state(model.head.state_dict(), reference.head.state_dict(), "head after the last step")


def case_submodule_load_state_dict_right_after_step(rank, world_size):
    """A head loaded alone while its update is pending keeps the loaded values, and training goes on exactly."""
    model, optimizer, reference, reference_optimizer = prepared_pair(functools.partial(torch.optim.SGD, lr=0.1))
    torch.manual_seed(1)
    fresh_head = nn.Linear(16, 4).state_dict()
    for iteration, (x, y) in enumerate(batches(world_size, ITERATIONS)):
        local_step(model, optimizer, x, y, iteration, rank)
        reference_step(reference, reference_optimizer, x, y, iteration, world_size)
        if iteration == WARMUP_ITERATIONS + 1:
            model.head.load_state_dict(fresh_head)
            reference.head.load_state_dict(fresh_head)
            assert_same_state(dict(model.head.named_parameters()), fresh_head, "head right after loading")
    assert_same_parameters(model, reference, rtol=1e-5, atol=1e-6)


def case_converted_after_prepare_is_refused(rank, world_size):
    model, optimizer, _, _ = prepared_pair(functools.partial(torch.optim.SGD, lr=0.1))
    x, y = next(batches(world_size))
    local_step(model, optimizer, x, y, 0, rank)
    model.to(torch.float64)
    with pytest.raises(RuntimeError, match=r"'embed.weight' changed dtype from torch.float32 to torch.float64"
                       r".*before\s+calling commsched.prepare\(\)"):
        model(x[rank_slice(rank)].double())


class Doubler(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return 2 * h


def case_parameter_free_module_added_after_prepare(rank, world_size):
    """Nothing commsched built depends on it: training goes on exactly."""
    model, optimizer, reference, reference_optimizer = prepared_pair(functools.partial(torch.optim.SGD, lr=0.1))
    for iteration, (x, y) in enumerate(batches(world_size, ITERATIONS)):
        if iteration == WARMUP_ITERATIONS + 1:
            for m in (model, reference):
                m.blocks[1] = Doubler()  # replaces a Tanh
                m.blocks.append(nn.ReLU())
        local_step(model, optimizer, x, y, iteration, rank)
        reference_step(reference, reference_optimizer, x, y, iteration, world_size)
    assert_same_parameters(model, reference, rtol=1e-5, atol=1e-6)


def case_module_wrapping_parameters_added_after_prepare_is_refused(rank, world_size):
    model, optimizer, _, _ = prepared_pair(functools.partial(torch.optim.SGD, lr=0.1))
    x, y = next(batches(world_size))
    local_step(model, optimizer, x, y, 0, rank)
    model.head_again = nn.Sequential(model.head)  # the head's parameters keep their names
    with pytest.raises(RuntimeError, match=r"'head_again' were added .* hold some of its parameters"):
        model(x[rank_slice(rank)])


def bn_batches(rank, count):
    generator = torch.Generator().manual_seed(50 + rank)
    for _ in range(count):
        yield torch.randn(4, 1, 6, 6, generator=generator) * (1 + rank), torch.randint(0, 3, (4,), generator=generator)


def case_buffers_under_accumulation_as_ddp(rank, world_size, idiom, strategy):
    """BatchNorm statistics, and the parameters they lead to, are DDP's in each accumulation idiom.

    ``no_sync``: the first micro-steps inside ``no_sync()``; ``backward_each``: a
    synchronised backward pass per micro-step, one ``step()``; ``eval_between``: a plain
    step, then evaluation under ``no_grad`` in ``eval()`` mode, then the next steps
    (compared after a training step: the evaluation's own forward pass broadcasts
    under DDP and not here; see [Note: when buffers are broadcast]).
    """
    torch.manual_seed(0)
    base = BatchNormNet()
    ddp = DistributedDataParallel(copy.deepcopy(base))
    ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = commsched.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1, momentum=0.9), strategy)
    data = list(bn_batches(rank, 3 * ITERATIONS))
    for m, o in ((ddp, ddp_optimizer), (model, optimizer)):
        for step in range(ITERATIONS):
            micro = data[3 * step:3 * step + 3]
            if idiom == "no_sync":
                with m.no_sync():
                    for x, y in micro[:2]:
                        F.cross_entropy(m(x), y).backward()
                F.cross_entropy(m(micro[2][0]), micro[2][1]).backward()
            elif idiom == "backward_each":
                for x, y in micro:
                    F.cross_entropy(m(x), y).backward()
            else:
                F.cross_entropy(m(micro[0][0]), micro[0][1]).backward()
            o.step()
            o.zero_grad()
            if idiom == "eval_between" and step % 2 == 1 and step < ITERATIONS - 1:
                m.eval()
                with torch.no_grad():
                    m(micro[1][0])
                m.train()
    model.state_dict()  # waits for pending updates
    compared = 0
    for (name, a), (_, e) in zip(list(model.named_parameters()) + list(model.named_buffers()),
                                 list(ddp.module.named_parameters()) + list(ddp.module.named_buffers()), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, msg=lambda msg, n=name: f"'{n}': {msg}")
        compared += 1
    assert compared > 0


def current_state(rank: int, world_size: int) -> None:
    cases = {}
    for name in TENSOR_LR_OPTIMIZERS:
        cases[f"tensor_lr_scheduler/{name}"] = functools.partial(
            case_tensor_learning_rate_under_a_scheduler, rank, world_size, name)
    for case in (case_submodule_state_dict_right_after_step, case_submodule_load_state_dict_right_after_step,
                 case_converted_after_prepare_is_refused, case_parameter_free_module_added_after_prepare,
                 case_module_wrapping_parameters_added_after_prepare_is_refused):
        cases[case.__name__.removeprefix("case_")] = functools.partial(case, rank, world_size)
    for idiom in ("no_sync", "backward_each", "eval_between"):
        for label, strategy in (("default", None), ("no_overlap", commsched.Strategy(overlap_forward=False))):
            cases[f"buffers_as_ddp/{idiom}/{label}"] = functools.partial(
                case_buffers_under_accumulation_as_ddp, rank, world_size, idiom, strategy)
    run_subtests(cases)


@in_shared_ranks(current_state, 2, timeout_s=240)
def test_state_read_through_any_module_is_current(shared_ranks):
    shared_ranks.result()
