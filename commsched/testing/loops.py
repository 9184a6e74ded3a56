"""Training loops beyond the plain one, each to be trained exactly like one process on the concatenated
batch: a ``step()`` without a backward pass, two steps on the same gradients, ``zero_grad()`` before
or between steps, a penalty on the parameters read before or after the forward pass, weight clipping
and an EMA right after ``step()``.

    run_subtests({loop: case(world_size, rank, loop, prepare=lambda m, o: commsched.prepare(m, o))
                  for loop in LOOPS})
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import commsched
from commsched.testing.models import CheckpointedNet
from commsched.testing.reference import OPTIMIZERS, one_process_loss, reference_copy

PER_RANK = 4
ITERATIONS = 8
"""Enough to pass warm-up (3 iterations) and the plan, so forward overlap is exercised."""


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
