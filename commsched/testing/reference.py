"""The single-process reference that data-parallel training must reproduce, and the optimizers it uses.

N ranks, each training on its share of a batch with the gradients averaged, must end
with the parameters of one process training on the whole (concatenated) batch with the
mean of the shares' losses. Every exactness test compares against that one-process run,
so it is written once, here: the copy is made before ``prepare()`` touches the model, its
optimizer is built by the same factory, and its loss is summed and divided in the same
order everywhere (a different order rounds differently).

    reference, reference_optimizer = reference_copy(model, OPTIMIZERS["adam"])
    model, optimizer = commsched.prepare(model, OPTIMIZERS["adam"](model.parameters()))
    ...
    one_process_step(reference_optimizer, lambda r: loss_of(reference, share[r]), world_size)
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, OptimizerFactory] = {
    # SGD: momentum and weight decay, so that a step depends on the ones before it.
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-2),
    "sgd_momentum_no_decay": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "sgd_momentum_lr_0.1": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd_dampening": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-2),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    # Adam divides by the gradients' own size: rounding in a gradient near zero shows.
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-2),
    "adam_no_decay": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam_eps_1e-4": lambda ps: torch.optim.Adam(ps, lr=1e-2, eps=1e-4),  # bfloat16 and float16: eps they hold
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw_eps_1e-4": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, eps=1e-4),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    # Two param groups, one with a tensor learning rate (which LR schedulers change in place).
    "adam_two_groups_tensor_lr": lambda ps: torch.optim.Adam(
        [{"params": (params := list(ps))[::2], "lr": torch.tensor(1e-2)},
         {"params": params[1::2], "lr": 5e-3, "weight_decay": 1e-2}], foreach=False),
    # No per-bucket update in commsched: the optimizer's own step() runs.
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
    "rmsprop_momentum": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
}
"""Every optimizer the exactness tests train with, by name: each test names the settings it uses,
and a model and its reference get theirs from the same factory."""


def reference_copy(model: nn.Module, make_optimizer: OptimizerFactory) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A deep copy of ``model`` with an optimizer of its own, built by ``make_optimizer``.

    Call it before ``commsched.prepare(model, ...)``, which adds hooks to the model and moves its
    gradients into buckets: the copy must be the plain model the user started from.
    """
    reference = copy.deepcopy(model)
    return reference, make_optimizer(reference.parameters())


def one_process_loss(loss_of_share: Callable[[int], torch.Tensor], world_size: int) -> torch.Tensor:
    """One process's loss on the concatenated batch: the mean of the ``world_size`` shares' losses.

    ``loss_of_share(r)`` computes rank ``r``'s loss on rank ``r``'s share, as rank ``r`` computes
    it (a branch it skips is skipped here too, so unused parameters match). With equal shares,
    the gradient of this mean is the average of the ranks' gradients: what the all-reduce makes.
    """
    return sum(loss_of_share(r) for r in range(world_size)) / world_size


def one_process_backward(loss_of_share: Callable[[int], torch.Tensor], world_size: int) -> torch.Tensor:
    """``one_process_loss(...).backward()``; returns the loss (e.g. for gradient accumulation)."""
    loss = one_process_loss(loss_of_share, world_size)
    loss.backward()
    return loss


def one_process_gradients_as_all_reduce(
    model: nn.Module, loss_of_share: Callable[[int], torch.Tensor], world_size: int
) -> None:
    """Set each gradient to what the all-reduce makes of the shares': each divided by
    ``world_size``, then summed in rank order, in the parameter's own dtype.

    For bfloat16 and float16, where `one_process_backward`'s gradient (the mean's, rounded
    once) differs from the all-reduce's (rounded at each step): with the gradients equal,
    what is compared is the update alone, and it must match torch.optim's bit for bit.
    """
    params = list(model.parameters())
    shares = []
    for r in range(world_size):
        model.zero_grad(set_to_none=True)
        loss_of_share(r).backward()
        shares.append([p.grad / world_size for p in params])
    for index, param in enumerate(params):
        total = shares[0][index]
        for share in shares[1:]:
            total = total + share[index]
        param.grad = total


def one_process_step(
    optimizer: torch.optim.Optimizer,
    loss_of_share: Callable[[int], torch.Tensor],
    world_size: int,
    *,
    set_to_none: bool = True,
) -> None:
    """One training step of the reference: backward on the concatenated batch, ``step()``, ``zero_grad()``."""
    one_process_backward(loss_of_share, world_size)
    optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)


def assert_same_parameters(actual: nn.Module, expected: nn.Module, *, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Every parameter of ``actual`` is close to ``expected``'s, and has a gradient exactly where it has one.

    ``actual.state_dict()`` first: under forward overlap it waits for the updates still pending.
    """
    actual.state_dict()
    compared = 0
    for (name, a), (_, e) in zip(actual.named_parameters(), expected.named_parameters(), strict=True):
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m, n=name: f"parameter '{n}': {m}")
        assert (a.grad is None) == (e.grad is None), (
            f"parameter '{name}': grad is None: {a.grad is None}, expected {e.grad is None}"
        )
        compared += 1
    assert compared > 0, "the models have no parameters: nothing was compared"


def assert_equal_on_all_ranks(model: nn.Module) -> None:
    """Every parameter and buffer is bit for bit the same on every rank of the default group (a collective)."""
    model.state_dict()  # waits for updates still pending under forward overlap
    compared = 0
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, tensor.detach().contiguous())
        for rank, other in enumerate(gathered):
            assert torch.equal(other, tensor), f"'{name}' differs between this rank and rank {rank}"
            compared += 1
    assert compared > 0, "the model has no parameters or buffers: nothing was compared"
