"""What a prepared optimizer gains: steps on averaged gradients, ``synchronize()``, and plain copies."""

from __future__ import annotations

import copy
import functools
import os
import weakref
from typing import Any, SupportsIndex

import torch

from commsched.engine.lifecycle import Lifecycle

# At run time, not only for type checkers: frameworks read the annotations of the
# classes commsched mixes in (transformers calls typing.get_type_hints on each model class).
from commsched.engine.reducer import GradientReducer
from commsched.update.base import ShardedState
from commsched.update.grad_scaling import GradScaling, forget_given, step_as_grad_scaler_would
from commsched.update.kinds import user_class

COMPRESSION_STATE_KEY = "commsched_powersgd"
"""Where ``optimizer.state_dict()`` holds this rank's compression state with ``Strategy(compression=...)``
(torch.optim's own ``load_state_dict`` ignores the entry)."""


class CommschedOptimizer:
    """Mixed into the class of a prepared optimizer (the optimizer object itself is kept).

    ``isinstance(opt, torch.optim.SGD)`` still holds, ``param_groups``, state and
    checkpoints keep torch.optim's format, and LR schedulers work unchanged.
    """

    _commsched_reducer: GradientReducer

    _step_supports_amp_scaling = True
    """``GradScaler.step`` hands ``step()`` the scale and its inf/NaN verdict instead of
    unscaling gradients in place; see [Note: GradScaler] in commsched/update/grad_scaling.py."""

    def synchronize(self) -> None:
        """Block until every pending gradient reduction (and update) is done."""
        self._commsched_reducer.synchronize_for_user()

    def save_sharded_state(self, checkpoint_id: str | os.PathLike) -> None:
        """With ``AllReduce(shard_optimizer=True)``: every rank writes its own part of the state
        with ``torch.distributed.checkpoint`` into ``checkpoint_id`` (a directory), nothing
        gathered. Collective: call it on every rank. ``state_dict()`` is the portable format."""
        sharded = _sharded_state(self._commsched_reducer)
        self._commsched_reducer.synchronize()
        sharded.save(checkpoint_id)

    def load_sharded_state(self, checkpoint_id: str | os.PathLike) -> None:
        """Read what `save_sharded_state` wrote, each rank its own part, where the world size and
        the buckets are the same (else refused with the fix). Collective; before the first forward
        pass it happens when the buckets are laid out."""
        sharded = _sharded_state(self._commsched_reducer)
        self._commsched_reducer.synchronize()
        sharded.load(checkpoint_id)

    def step(self, closure: Any = None) -> Any:
        """Release this iteration's update.

        Without forward overlap the update runs now; with it, ``step()`` returns at
        once and each bucket is updated when its reduction completes.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        optimizer_step = super(CommschedOptimizer, self).step  # type: ignore[misc]
        scaling = GradScaling.given_to(self)  # type: ignore[arg-type]
        if scaling is not None:
            optimizer_step = functools.partial(step_as_grad_scaler_would, self, optimizer_step, scaling)
        try:
            self._commsched_reducer.step(optimizer_step, scaling)
        except BaseException:
            if scaling is not None:
                forget_given(self)  # type: ignore[arg-type]
            raise
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._commsched_reducer.before_zero_grad(set_to_none)
        super().zero_grad(set_to_none)  # type: ignore[misc]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused until ``commsched.release``: param groups are read once, when the buckets
        and their per-bucket updates are built, so a later group would never be updated."""
        if self._commsched_reducer.lifecycle is not Lifecycle.RELEASED:
            raise RuntimeError(
                "add_param_group() was called on an optimizer already passed to commsched.prepare(); "
                "its param groups are fixed there, so the new group would never be updated. Add every "
                "param group before prepare(): a group that should train only later can start with "
                "lr=0 and get its learning rate then (hyper-parameters are read at every step(); "
                "momentum and Adam's moments still see its gradients from the start). Its parameters "
                "must have requires_grad=True at prepare(): parameters frozen there cannot be unfrozen."
            )
        super().add_param_group(param_group)  # type: ignore[misc]

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state dict; with parameter servers, their state is fetched first."""
        self._commsched_fetch_state()
        try:
            state = super().state_dict()  # type: ignore[misc]
        finally:
            self._commsched_drop_fetched_state()
        compression = self._commsched_reducer.transport.compression
        if compression is not None:
            self.synchronize()  # the errors and Q of this iteration's reductions
            state[COMPRESSION_STATE_KEY] = compression.state_dict(self._commsched_reducer.transport.rank)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as torch.optim does; with parameter servers, the state is sent to them too; with
        compression, its state (`COMPRESSION_STATE_KEY`) goes to the compressor."""
        self.synchronize()
        compression = self._commsched_reducer.transport.compression
        if COMPRESSION_STATE_KEY in state_dict:
            state_dict = dict(state_dict)
            saved = state_dict.pop(COMPRESSION_STATE_KEY)
            if compression is not None:
                compression.load_state_dict(saved, self._commsched_reducer.transport.rank)
        super().load_state_dict(state_dict)  # type: ignore[misc]
        elsewhere = self._commsched_reducer.policy.state_elsewhere
        if elsewhere is not None:
            elsewhere.push_optimizer_state()

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.optim.Optimizer:
        """A plain copy: the user's optimizer class, with its state and param groups, without commsched.

        The reducer holds process groups, which cannot be copied. Pending updates
        run first (and, with parameter servers, their state is fetched, as for
        ``state_dict()``), so the copy holds the state ``step()`` made. As torch
        does, parameters are copied through ``memo``: deep-copied together with
        the model (``copy.deepcopy({"model": model, "opt": opt})``), the copy
        steps the copied model's parameters. The original keeps training.
        """
        self._commsched_fetch_state()
        cls = user_class(self)  # type: ignore[arg-type]
        plain = cls.__new__(cls)
        memo[id(self)] = plain
        try:
            plain.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        finally:
            self._commsched_drop_fetched_state()
        return plain

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        """Whole-optimizer pickling (``torch.save(opt)``) stores a plain optimizer of the user's class.

        The mixed class cannot be found by name when loading, and the reducer
        cannot be pickled. State and parameters are pickled as they are, after
        pending updates; a model pickled in the same file shares its parameters.
        """
        self._commsched_fetch_state()
        cls = user_class(self)  # type: ignore[arg-type]
        fields = dict(self.__getstate__())
        fields["state"] = copy.copy(fields["state"])  # what was fetched leaves self.state below
        self._commsched_drop_fetched_state()
        # Not copyreg.__newobj__: pickle lets it rebuild only the pickled object's own (mixed) class.
        return (cls.__new__, (cls,), fields)

    def _commsched_fetch_state(self) -> None:
        """Pending updates done, and (with parameter servers) their state fetched into ``self.state``."""
        reducer = self._commsched_reducer
        reducer.synchronize()
        if reducer.policy.state_elsewhere is not None:
            reducer.policy.state_elsewhere.fetch()

    def _commsched_drop_fetched_state(self) -> None:
        elsewhere = self._commsched_reducer.policy.state_elsewhere
        if elsewhere is not None:
            elsewhere.drop_fetched()


NOT_SHARDED = (
    "sharded checkpoints need Strategy(backend=AllReduce(shard_optimizer=True)); without it every rank holds "
    "the whole optimizer state: save optimizer.state_dict() and load it with optimizer.load_state_dict()"
)


def _sharded_state(reducer: GradientReducer) -> ShardedState:
    if reducer.policy.sharded is None:
        raise ValueError(NOT_SHARDED)
    return reducer.policy.sharded


def keep_scheduler_counting_steps(optimizer: torch.optim.Optimizer) -> None:
    """Let an LR scheduler made before ``optimizer`` was prepared go on seeing its steps.

    A scheduler replaces ``optimizer.step`` on the object by a wrapper that notes
    the call and then runs the step of the class the optimizer had then, which
    would now skip commsched's. The wrapper is replaced by one that notes the
    same and runs the prepared step.
    """
    patched = vars(optimizer).get("step")
    if not getattr(patched, "_wrapped_by_lr_sched", False):
        return
    optimizer_ref = weakref.ref(optimizer)

    @functools.wraps(patched)
    def step(*args: Any, **kwargs: Any) -> Any:
        prepared = optimizer_ref()
        prepared._opt_called = True  # what torch's LR schedulers look for
        return type(prepared).step(prepared, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    vars(optimizer)["step"] = step
