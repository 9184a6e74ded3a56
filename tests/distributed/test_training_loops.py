"""Training loops beyond the README's: each trains exactly like one process on the concatenated batch.

Activation checkpointing (both kinds, also where the first gradients come from
a nested backward pass), a ``step()`` without a backward pass, a penalty on the
parameters read before or after the forward pass, weight clipping and an EMA
right after ``step()``; on the all-reduce backend with and without forward
overlap, and on parameter servers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from torch import nn

import commsched
from commsched.testing import OPTIMIZERS, one_process_loss, reference_copy, run_subtests
from tests.distributed.test_ps import prepare_or_serve
from tests.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed

PER_RANK = 4
ITERATIONS = 8
"""Enough to pass warm-up (3 iterations) and the plan, so forward overlap is exercised."""


class CheckpointedNet(nn.Module):
    """An MLP whose blocks may run under ``torch.utils.checkpoint``.

    ``checkpointed``: which blocks recompute in backward ("middle": the two
    hidden blocks; "last": the head too, so with reentrant checkpointing the
    first gradients of each iteration come from a nested backward pass).
    ``unused`` never gets a gradient, so the end of backward must be found.
    """

    def __init__(self, reentrant: bool | None = None, checkpointed: str = "middle"):
        super().__init__()
        self.reentrant, self.checkpointed = reentrant, checkpointed
        self.embed = nn.Linear(8, 16)
        self.b1 = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.b2 = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)
        self.unused = nn.Linear(4, 4)

    def _run(self, block: nn.Module, h: torch.Tensor, checkpointed: bool) -> torch.Tensor:
        if self.reentrant is None or not checkpointed:
            return block(h)
        return checkpoint.checkpoint(block, h, use_reentrant=self.reentrant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = self._run(self.b1, h, True)
        h = self._run(self.b2, h, self.checkpointed == "middle")
        return self._run(self.head, h, self.checkpointed == "last")


def norm_penalty(model: nn.Module) -> torch.Tensor:
    """Not linear in the parameters, so stale values change the gradients."""
    return 0.1 * sum((p**2).sum().sqrt() for n, p in model.named_parameters() if not n.startswith("unused"))


LOOPS = ("plain", "step_without_backward", "step_twice", "zero_grad_in_place_then_step",
         "zero_grad_before_step", "penalty_before_forward", "penalty_after_forward", "clip_weights_after_step",
         "ema_after_step")


def train(model, optimizer, loop: str, world_size: int, rank: int | None) -> dict[str, torch.Tensor]:
    """``ITERATIONS`` of ``loop``: rank ``rank``'s slice of each batch, or (None) the whole batch.

    Returns the parameters, and the EMA where the loop keeps one.
    """
    generator = torch.Generator().manual_seed(7)
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    for iteration in range(ITERATIONS):
        x = torch.randn(world_size * PER_RANK, 8, generator=generator)
        y = torch.randn(world_size * PER_RANK, 4, generator=generator)

        def loss_of_share(r: int, x=x, y=y) -> torch.Tensor:
            return F.mse_loss(model(x[r * PER_RANK:(r + 1) * PER_RANK]), y[r * PER_RANK:(r + 1) * PER_RANK])

        penalty = norm_penalty(model) if loop == "penalty_before_forward" else 0.0
        loss = one_process_loss(loss_of_share, world_size) if rank is None else loss_of_share(rank)
        if loop == "penalty_after_forward":
            penalty = norm_penalty(model)
        (loss + penalty).backward()
        if loop == "zero_grad_before_step" and iteration % 3 == 2:
            optimizer.zero_grad()  # torch: the step below changes nothing
        optimizer.step()
        if loop == "step_twice" and iteration % 3 == 1:
            optimizer.step()  # the same gradients again
        if loop == "zero_grad_in_place_then_step" and iteration % 3 == 1:
            optimizer.zero_grad(set_to_none=False)
            optimizer.step()  # zero gradients: momentum and weight decay still apply
        optimizer.zero_grad()
        if loop == "step_without_backward" and iteration % 3 == 1:
            optimizer.step()  # no gradients: torch changes nothing
        if loop == "clip_weights_after_step":
            with torch.no_grad():
                for p in model.parameters():
                    p.clamp_(-0.2, 0.2)
        if loop == "ema_after_step":
            with torch.no_grad():
                for n, p in model.named_parameters():
                    ema[n].mul_(0.5).add_(p, alpha=0.5)
    if hasattr(optimizer, "synchronize"):
        optimizer.synchronize()
    result = {n: p.detach().clone() for n, p in model.named_parameters()}
    if loop == "ema_after_step":
        result.update({f"ema.{n}": v for n, v in ema.items()})
    return result


def compare(model, make_optimizer, world_size, rank, loop, prepare) -> None:
    reference, reference_optimizer = reference_copy(model, make_optimizer)
    prepared = prepare(model, make_optimizer(model.parameters()))
    if prepared is None:
        return  # a parameter-server rank: it served until the workers finished
    model, optimizer = prepared
    got = train(model, optimizer, loop, world_size, rank)
    assert isinstance(model, commsched.CommschedModule), type(model)
    commsched.release(model)
    want = train(reference, reference_optimizer, loop, world_size, None)
    assert want.keys() == got.keys() and want, "nothing to compare"
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def case(world_size, rank, loop, optimizer="sgd_momentum", reentrant=None, checkpointed="middle", prepare=None):
    def run() -> None:
        torch.manual_seed(0)
        model = CheckpointedNet(reentrant, checkpointed)
        compare(model, OPTIMIZERS[optimizer], world_size, rank, loop, prepare)

    return run


def all_reduce(strategy):
    return lambda model, optimizer: commsched.prepare(model, optimizer, strategy)


def loops_on_all_reduce(rank: int, world_size: int) -> None:
    cases = {}
    for label, strategy in (("default", commsched.Strategy()),
                            ("no_overlap", commsched.Strategy(overlap_forward=False)),
                            ("no_priority", commsched.Strategy(priority=False))):
        prepare = all_reduce(strategy)
        for reentrant in (True, False):
            for checkpointed in ("middle", "last"):
                kind = "reentrant" if reentrant else "non_reentrant"
                cases[f"{label} {kind} checkpoint of {checkpointed}"] = case(
                    world_size, rank, "plain", "sgd_momentum", reentrant, checkpointed, prepare)
        for loop in LOOPS[1:]:
            cases[f"{label} {loop}"] = case(world_size, rank, loop, "sgd_momentum", prepare=prepare)
    default = all_reduce(commsched.Strategy())
    for loop in ("step_without_backward", "step_twice", "zero_grad_before_step", "penalty_before_forward"):
        cases[f"adam {loop}"] = case(world_size, rank, loop, "adam", prepare=default)
    cases["penalty before forward with reentrant checkpoints"] = case(
        world_size, rank, "penalty_before_forward", "sgd_momentum", True, "middle", default)
    run_subtests(cases)


@in_shared_ranks(loops_on_all_reduce, 2, timeout_s=400)
def test_training_loops_on_all_reduce(shared_ranks):
    shared_ranks.result()


def loops_on_parameter_servers(rank: int, world_size: int) -> None:
    workers = world_size - 1

    def prepare(model, optimizer):
        return prepare_or_serve(model, optimizer, num_servers=1)

    cases = {}
    for reentrant in (True, False):
        for checkpointed in ("middle", "last"):
            cases[f"{'reentrant' if reentrant else 'non_reentrant'} checkpoint of {checkpointed}"] = case(
                workers, rank, "plain", "sgd_momentum", reentrant, checkpointed, prepare)
    # A step after zero_grad() between backward() and step(), or twice on the same gradients, is
    # refused there (tests/distributed/test_ps.py); clipping weights on a worker is not supported.
    for loop in ("step_without_backward", "penalty_before_forward", "penalty_after_forward", "ema_after_step"):
        cases[loop] = case(workers, rank, loop, "adam", prepare=prepare)
    run_subtests(cases)


@in_shared_ranks(loops_on_parameter_servers, 3, timeout_s=400)
def test_training_loops_on_parameter_servers(shared_ranks):
    shared_ranks.result()
