"""`commsched.DistributedDataParallel`: torch DDP's constructor and interface, trained by commsched.

For scripts written for torch DDP, the swap is the import line. It is a
wrapper, as torch's is, and a subclass of torch's class, because the code
around DDP scripts tells them apart that way: ``ddp.module`` is the user's
model, ``ddp.state_dict()`` keys start with ``module.`` (checkpoints load
either way), and ``isinstance(model, torch.nn.parallel.DistributedDataParallel)``
holds, so the unwrapping in Lightning, accelerate, ``torch.distributed.checkpoint``
and people's own save code keeps working. torch's constructor is never run:
every method a training script calls is commsched's, and torch's private
machinery (its reducer, comm hooks) does not exist here.

The optimizer is usually built after the wrapper, from ``ddp.parameters()``:
it is adopted at its first ``step()`` (see [Note: an adopted optimizer] in
`commsched.engine.reducer`); pass ``optimizer=`` to give it at once.
The migration table (every torch DDP argument, attribute and idiom) is in
docs/integrations/ddp.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook
from torch.utils._pytree import tree_map_only

from commsched.api import prepare, prepare_adopting_optimizer, rewire_before_training
from commsched.integrations.comm_hooks import builtin_hook, settings_for_hook
from commsched.prepared.module import drop_raw_view
from commsched.strategy import Strategy

_REFUSED = {
    "delay_all_reduce_named_params": "commsched issues every gradient by its own plan; leave it None",
    "param_to_hook_all_reduce": "commsched issues every gradient by its own plan; leave it None",
    "mixed_precision": (
        "for gradients reduced in another dtype use commsched.Strategy(reduce_dtype=torch.bfloat16 or "
        "torch.float32), and torch.autocast for the forward pass"
    ),
    "bucket_cap_mb_list": "give one size as bucket_cap_mb (and the first bucket's as Strategy(first_bucket_mb=...))",
}


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """A drop-in for ``torch.nn.parallel.DistributedDataParallel`` that trains with commsched.

    Takes torch DDP's arguments. Those with a meaning here are used:
    ``process_group`` or a one-dimensional ``device_mesh``; ``bucket_cap_mb``;
    ``broadcast_buffers`` (or ``forward_sync_buffers``); ``device_ids`` and
    ``output_device``, which must name the device the module is on (inputs are
    moved there, as torch does). These are accepted and need nothing:
    ``find_unused_parameters`` (unused parameters are found at every
    iteration), ``static_graph`` and ``check_reduction`` (the graph is learnt in
    warm-up and checked after), ``gradient_as_bucket_view`` (gradients are
    always views of the buckets), ``skip_all_reduce_unused_params`` and
    ``batched_grad_copy``, ``init_sync`` (rank 0's parameters and buffers are
    always copied to every rank). Those that hand commsched's job to the
    caller are refused, with what to use instead.

    ``strategy``: commsched's settings (DDP's arguments above are applied on
    top); ``optimizer``: the optimizer, if it exists already (otherwise the
    first one to step every parameter is adopted).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        strategy: Strategy | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ):
        torch.nn.Module.__init__(self)
        given = {"delay_all_reduce_named_params": delay_all_reduce_named_params,
                 "param_to_hook_all_reduce": param_to_hook_all_reduce, "mixed_precision": mixed_precision,
                 "bucket_cap_mb_list": bucket_cap_mb_list}
        for name, value in given.items():
            if value is not None:
                raise ValueError(f"commsched.DistributedDataParallel does not take {name}: {_REFUSED[name]}")
        if dim != 0:
            raise ValueError("commsched.DistributedDataParallel runs one device per process: dim must be 0")
        if process_group is not None and device_mesh is not None:
            raise ValueError("pass process_group or device_mesh, not both (as torch DDP)")
        if device_mesh is not None:
            if device_mesh.ndim != 1:
                raise ValueError(
                    f"device_mesh has {device_mesh.ndim} dimensions; pass the data-parallel one "
                    "(mesh['dp'], say), or its process group as process_group")
            process_group = device_mesh.get_group()
        device = _module_device(module, device_ids, output_device)
        strategy = _with_ddp_arguments(strategy or Strategy(), bucket_cap_mb, broadcast_buffers, forward_sync_buffers)
        if optimizer is not None:
            prepare(module, optimizer, strategy, process_group)
        else:
            prepare_adopting_optimizer(module, strategy, process_group)
        drop_raw_view(module)  # self.module is the model, and it has no .module, as under torch DDP
        self.module = module
        self.strategy = strategy
        # torch DDP's public attributes, for code that reads them.
        self.device_ids = None if device_ids is None else [device]
        self.output_device = None if device_ids is None else device
        self.device = device
        self.device_type = device.type
        self.dim = dim
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.forward_sync_buffers = strategy.broadcast_buffers
        self.bucket_bytes_cap = int(strategy.bucket_cap_mb * 1024 * 1024)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = True
        self.static_graph = static_graph
        self._move_inputs = device_ids is not None
        self._comm_hook: Any = None

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._move_inputs:
            inputs, kwargs = tree_map_only(torch.Tensor, lambda t: t.to(self.device, non_blocking=True),
                                           (inputs, kwargs))
        return self.module(*inputs, **kwargs)

    @property
    def require_backward_grad_sync(self) -> bool:
        """False: backward passes accumulate locally (as inside ``no_sync()``)."""
        return self.module.require_backward_grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, enabled: bool) -> None:
        self.module.require_backward_grad_sync = enabled

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """As torch DDP's: the micro-batches inside accumulate, the first backward outside reduces."""
        with self.module.no_sync():
            yield

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """torch DDP's uneven-inputs context: ``Join([self])``."""
        if not divide_by_initial_world_size:
            raise ValueError(
                "commsched averages over every rank, as torch DDP's default: "
                "divide_by_initial_world_size must be True")
        return Join([self], enable=enable, throw_on_early_termination=throw_on_early_termination)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return self.module.join_hook(**kwargs)

    @property
    def join_device(self) -> torch.device:
        return self.module.join_device

    @property
    def join_process_group(self) -> Any:
        return self.module.join_process_group

    @property
    def _join_config(self) -> Any:
        # torch's Join sets and reads this on the joinable it was given; the engine
        # reads it on the prepared model.
        return self.module._join_config

    @_join_config.setter
    def _join_config(self, config: Any) -> None:
        self.module._join_config = config

    def register_comm_hook(self, state: object, hook: Any) -> None:
        """torch's built-in hooks, as commsched's own settings (`commsched.integrations.comm_hooks`),
        before the first forward pass; once, as torch DDP allows. Collective, as under torch DDP."""
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once, as with torch DDP (this model has "
                               f"{getattr(self._comm_hook, '__qualname__', self._comm_hook)} already)")
        settings = settings_for_hook(self.strategy, state, hook, self.process_group)
        compressor = rewire_before_training(self.module, settings.strategy)
        if compressor is not None and settings.powersgd_generator is not None:
            compressor.continue_from(settings.powersgd_iterations, settings.powersgd_generator.get_state())
        self.strategy = settings.strategy
        self._comm_hook = hook

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        self.register_comm_hook(None, builtin_hook(comm_hook_type))

    def _set_static_graph(self) -> None:
        """Nothing to do: the graph is learnt in warm-up, as static_graph=True would let DDP do."""

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.nn.Module:
        raise RuntimeError(
            "a commsched.DistributedDataParallel cannot be copied (it holds process groups): "
            "copy.deepcopy(model.module) gives a plain copy of your model with its current parameters")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError(
            "a commsched.DistributedDataParallel cannot be pickled (it holds process groups): "
            "save model.module (torch.save(model.module) or its state_dict()) instead")


def _module_device(module: torch.nn.Module, device_ids: Sequence[int | str | torch.device] | None,
                   output_device: int | str | torch.device | None) -> torch.device:
    """The one device the module is on, checked against ``device_ids`` and ``output_device``."""
    devices = {p.device for p in module.parameters()}
    if len(devices) != 1:
        raise ValueError(
            f"the module's parameters are on {len(devices)} devices ({', '.join(map(str, devices))}); "
            "commsched.DistributedDataParallel trains a module on one device per process")
    (device,) = devices
    if device_ids is None:
        return device
    if len(device_ids) != 1 or _as_device(device_ids[0], device) != device:
        raise ValueError(
            f"device_ids={list(device_ids)} must name the one device the module is on ({device}): "
            "move the module there first (module.to(device)), as torch DDP requires")
    if output_device is not None and _as_device(output_device, device) != device:
        raise ValueError(f"output_device={output_device} must be the module's device ({device})")
    return device


def _as_device(value: int | str | torch.device, like: torch.device) -> torch.device:
    device = torch.device(like.type, value) if isinstance(value, int) else torch.device(value)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _with_ddp_arguments(strategy: Strategy, bucket_cap_mb: float | None, broadcast_buffers: bool | None,
                        forward_sync_buffers: bool | None) -> Strategy:
    changes: dict[str, Any] = {}
    if bucket_cap_mb is not None:
        changes["bucket_cap_mb"] = float(bucket_cap_mb)
    if broadcast_buffers is not None and forward_sync_buffers is not None and broadcast_buffers != forward_sync_buffers:
        raise ValueError("broadcast_buffers and forward_sync_buffers disagree; pass one of them")
    buffers = broadcast_buffers if broadcast_buffers is not None else forward_sync_buffers
    if buffers is not None:
        changes["broadcast_buffers"] = bool(buffers)
    return dataclasses.replace(strategy, **changes) if changes else strategy
