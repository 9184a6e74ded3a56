"""Optimizers that `commsched.prepare` was not given, stepping parameters it prepared.

[Note: foreign optimizers] A second optimizer over some of a prepared model's
parameters (Adam for the head, SGD for the body) steps with whatever
``param.grad`` holds at its ``step()``. With forward overlap, ``backward()``
returns before reductions finish, so that is this rank's own gradient, or a
half-reduced one, and the ranks drift apart. One global optimizer step
pre-hook (installed at the first ``prepare``) looks up each stepping
optimizer's parameters by id:

- no reduction can be in flight (forward overlap off: the end of backward
  waits for every reduction; or the user called ``optimizer.synchronize()``
  since that backward): the step goes ahead, exactly as in single-process
  training;
- forward overlap on, or still possible during warm-up: `RuntimeError` at the
  first such step, not only once overlap starts, naming the optimizer, the
  parameter and the fixes;
- a backend where the update happens elsewhere (parameter servers hold the
  values: `UpdatePolicy.foreign_step_refusal`), or a step inside a backward
  pass (gradients not averaged yet): `RuntimeError`.

The prepared optimizer itself, optimizers over other models' parameters, and
any optimizer once the model is released are not concerned. A model prepared
without an optimizer that may adopt one (`commsched.DistributedDataParallel`)
adopts, at its first ``step()``, an optimizer over every one of its trainable
parameters (see [Note: an adopted optimizer] in `commsched.engine.reducer`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from commsched.engine.lifecycle import Lifecycle
from commsched.update.kinds import user_class
from commsched.watch.autograd_context import running_backward

if TYPE_CHECKING:
    from commsched.engine.reducer import GradientReducer


Adopter = Callable[[torch.optim.Optimizer], Callable[[], None]]
"""Takes an optimizer as the prepared one; returns what runs after its first step."""


class _Owner(NamedTuple):
    param: weakref.ref
    """Guards against a freed parameter's id being reused."""
    name: str
    reducer: weakref.ref


_owners: dict[int, _Owner] = {}
"""id(parameter) -> the prepared model's reducer and the parameter's name there."""
_prepared_optimizers: weakref.WeakSet = weakref.WeakSet()
_adopters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""reducer -> how it adopts an optimizer, while it may."""
_hook: Any = None


def watch_foreign_optimizers(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, reducer: GradientReducer,
    adopter: Adopter | None = None,
) -> None:
    """Called by `commsched.prepare`: refuse other optimizers' steps on ``model``'s
    trainable parameters where they would be wrong; see [Note: foreign optimizers]."""
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_before_optimizer_step)
    for key in [key for key, owner in _owners.items() if owner.param() is None or owner.reducer() is None]:
        del _owners[key]
    reducer_ref = weakref.ref(reducer)
    for name, param in model.named_parameters():
        if param.requires_grad:
            _owners[id(param)] = _Owner(weakref.ref(param), name, reducer_ref)
    if optimizer is not None:
        _prepared_optimizers.add(optimizer)
    if adopter is not None:
        _adopters[reducer] = adopter


def _before_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Every optimizer's ``step()`` in the process: one dict lookup per parameter."""
    if not _owners or optimizer in _prepared_optimizers:
        return
    if _adopters and _adopted(optimizer):
        return
    checked: set[int] = set()
    for group in optimizer.param_groups:
        for param in group["params"]:
            owner = _owners.get(id(param))
            if owner is None or owner.param() is not param:
                continue
            reducer = owner.reducer()
            if reducer is not None and id(reducer) not in checked:
                checked.add(id(reducer))
                _check(optimizer, owner.name, reducer)


def _adopted(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a prepared model awaiting an optimizer took ``optimizer``: one over exactly its
    trainable parameters, at that optimizer's first step during warm-up."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    owner = _owners.get(id(params[0])) if params else None
    reducer = owner.reducer() if owner is not None and owner.param() is params[0] else None
    if reducer is None or reducer not in _adopters:
        return False
    if not reducer.awaiting_optimizer or reducer.lifecycle is Lifecycle.RELEASED or running_backward():
        del _adopters[reducer]
        return False
    if {id(p) for p in params} != {id(p) for p in reducer.params} or len(params) != len(reducer.params):
        return False
    adopter = _adopters.pop(reducer)
    after_step = adopter(optimizer)
    _prepared_optimizers.add(optimizer)
    handle = None

    def after_first_step(*_: Any) -> None:
        handle.remove()
        after_step()

    handle = optimizer.register_step_post_hook(after_first_step)
    return True


SEVERAL_MODELS_REASON = (
    "one optimizer steps this model's parameters and other models' (several commsched.DistributedDataParallel "
    "wrappers, one optimizer), so it steps as torch.optim does once backward() has averaged every gradient; "
    "for forward overlap, wrap one module that holds them all (torch.nn.ModuleDict) and build the optimizer "
    "from its parameters"
)
"""[Note: one optimizer over several models] A model awaiting an optimizer (the drop-in wrapper) adopts
one over exactly its trainable parameters. One over all of them and more (an encoder and a decoder each
wrapped, one optimizer), as torch DDP allows, is not adopted: the model trains as without an optimizer of
its own, forward overlap off, and the optimizer steps on averaged gradients, exactly."""


def _steps_all_of(optimizer: torch.optim.Optimizer, reducer: GradientReducer) -> bool:
    """Whether ``optimizer`` steps every trainable parameter of ``reducer``'s model, and others too."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return len(stepped) > len(reducer.params) and all(id(p) in stepped for p in reducer.params)


def _check(optimizer: torch.optim.Optimizer, name: str, reducer: GradientReducer) -> None:
    if reducer.lifecycle is Lifecycle.RELEASED:
        return
    who = (f"torch.optim optimizer {user_class(optimizer).__name__}, which was not passed to "
           f"commsched.prepare(), is stepping parameter '{name}' of a prepared model")
    one_optimizer = ("Put every parameter in the one optimizer given to prepare() (param groups may set "
                     "their own lr, weight_decay, momentum or betas)")
    if reducer in _adopters and _steps_all_of(optimizer, reducer):
        # [Note: one optimizer over several models] (torch DDP's wrappers allow it).
        del _adopters[reducer]
        reducer.decline_optimizer(SEVERAL_MODELS_REASON)
    if reducer in _adopters:
        one_optimizer = ("commsched.DistributedDataParallel adopts one optimizer over every trainable parameter "
                         "of the model (param groups may set their own lr, weight_decay, momentum or betas): "
                         "build one such optimizer")
    if running_backward():
        raise RuntimeError(
            f"{who} during a backward pass, before its gradient is averaged across ranks. Step "
            "optimizers after backward() returns."
        )
    refusal = reducer.policy.foreign_step_refusal
    if refusal is not None:
        raise RuntimeError(f"{who}. {refusal}. {one_optimizer}.")
    # The user's own synchronize() only: commsched synchronizes on its own too, during
    # warm-up, and that must not count, or the error would come only once overlap starts.
    current = reducer.current
    if reducer.overlap_off_reason is None and not (current is not None and current.synchronized_by_user):
        raise RuntimeError(
            f"{who}. With forward overlap (Strategy.overlap_forward=True) backward() and step() return "
            "before the gradients are averaged across ranks, so it would step with this rank's own "
            f"gradients and the ranks would drift apart. {one_optimizer}; to keep optimizers of "
            "different classes, use commsched.Strategy(overlap_forward=False), where backward() returns "
            "with every gradient averaged, or call synchronize() on the prepared optimizer before "
            "stepping this one."
        )
    reducer.synchronize()  # nothing should be in flight now: make sure (cheap when so)
