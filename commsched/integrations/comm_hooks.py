"""torch DDP's built-in communication hooks, as commsched's own settings.

A script that trains with ``ddp.register_comm_hook(state, hook)`` keeps the line under
`commsched.DistributedDataParallel`: each built-in hook has a commsched setting with its meaning,
applied before the first forward pass, and then scheduled like any other bucket's reduction.

=================================  ======================================================
torch hook                         commsched
=================================  ======================================================
``default_hooks.allreduce_hook``   the default all-reduce (nothing changes)
``default_hooks.bf16_compress_hook`` ``Strategy(reduce_dtype=torch.bfloat16)``
``default_hooks.fp16_compress_hook`` ``Strategy(reduce_dtype=torch.float16)``
``powerSGD_hook.powerSGD_hook``    ``Strategy(compression=PowerSGD(...))``, from its state
=================================  ======================================================

Any other hook is refused, naming the way to the same result: a hook's Python code runs on
DDP's buckets, which commsched does not have.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from commsched.strategy import PowerSGD, Strategy


@dataclasses.dataclass(frozen=True)
class HookSettings:
    """What a built-in hook means here: the strategy to train with, and what its state carries over."""

    strategy: Strategy
    powersgd_iterations: int = 0
    """With ``powerSGD_hook``: the iterations its state counted already (usually 0)."""
    powersgd_generator: Any = None
    """With ``powerSGD_hook``: its state's ``numpy.random.RandomState``, whose next draws seed the first Q."""


def settings_for_hook(strategy: Strategy, state: object, hook: Any, group: dist.ProcessGroup) -> HookSettings:
    """``strategy`` changed to mean what ``register_comm_hook(state, hook)`` means for torch DDP on
    ``group``, or a ValueError naming the fix."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook is default_hooks.allreduce_hook:
        _check_group(state, group, "allreduce_hook")
        return HookSettings(strategy)
    for name, dtype in (("bf16_compress_hook", torch.bfloat16), ("fp16_compress_hook", torch.float16)):
        if hook is getattr(default_hooks, name):
            _check_group(state, group, name)
            return HookSettings(dataclasses.replace(strategy, reduce_dtype=dtype))
    if hook is powerSGD_hook.powerSGD_hook:
        if not isinstance(state, powerSGD_hook.PowerSGDState):
            raise ValueError(f"powerSGD_hook takes a PowerSGDState, got {type(state).__name__}")
        _check_group(state.process_group, group, "powerSGD_hook")
        compression = PowerSGD(
            matrix_approximation_rank=state.matrix_approximation_rank,
            start_powerSGD_iter=state.start_powerSGD_iter, min_compression_rate=state.min_compression_rate,
            use_error_feedback=state.use_error_feedback, warm_start=state.warm_start,
            orthogonalization_epsilon=state.orthogonalization_epsilon,
            batch_tensors_with_same_shape=state.batch_tensors_with_same_shape)
        return HookSettings(dataclasses.replace(strategy, compression=compression), state.iter, state.rng)
    if hook is powerSGD_hook.batched_powerSGD_hook:
        raise ValueError(
            "batched_powerSGD_hook compresses each DDP bucket as one square matrix, which commsched's buckets "
            "(sized and ordered for the schedule) would change the meaning of; use powerSGD_hook with the same "
            "PowerSGDState (each gradient compressed on its own), or "
            "strategy=commsched.Strategy(compression=commsched.PowerSGD(...)) on the wrapper")
    name = getattr(hook, "__qualname__", type(hook).__name__)
    raise ValueError(
        f"commsched.DistributedDataParallel takes torch's built-in comm hooks only (allreduce_hook, "
        f"bf16_compress_hook, fp16_compress_hook, powerSGD_hook), got {name}: its code would run on DDP's buckets, "
        "which commsched does not have. For bytes saved on the wire use Strategy(reduce_dtype=...) or "
        "Strategy(compression=commsched.PowerSGD(...)); for anything else keep torch DDP for this model")


def builtin_hook(comm_hook_type: Any) -> Any:
    """The Python hook of ``dist.BuiltinCommHookType`` ``comm_hook_type`` (``_register_builtin_comm_hook``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hooks = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
             dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
    if comm_hook_type not in hooks:
        raise ValueError(f"unknown built-in comm hook {comm_hook_type!r}: expected one of {list(hooks)}")
    return hooks[comm_hook_type]


def _check_group(state: object, group: dist.ProcessGroup, hook: str) -> None:
    """A hook's state names the group it reduces over (None: the default group): it must be the wrapper's."""
    if state is None or state is group or (state is dist.group.WORLD and group is dist.group.WORLD):
        return
    if isinstance(state, dist.ProcessGroup):
        if dist.get_process_group_ranks(state) == dist.get_process_group_ranks(group):
            return
        raise ValueError(f"{hook}'s process group is not the one this model is trained on: pass that group (or "
                         "None) as the hook's state")
    raise ValueError(f"{hook} takes a process group or None as its state, got {type(state).__name__}")
