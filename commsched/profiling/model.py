"""Measure a model's per-parameter timeline in one process: `profile_model`.

`profile_model` trains a model for a few iterations in this process (no
process group) and records, per trainable parameter, when the forward pass
first reads it and when its gradient is ready, and per module its forward and
backward times: the `Profile` that ``commsched plan`` and the simulator
replay. `scaled_compute` asks "what if this device were X times faster".

[Note: when a parameter is first read] Per iteration, every module's forward
pre-hook and forward hook is an *event* with a time. One untimed forward pass
first runs under a torch-function mode (`commsched.watch.parameter_use`) and notes,
per parameter, how many events had happened when a torch function first
received it. In the timed iterations a parameter's ``first_use_s`` is the time
of the last event before its first read: for a parameter read by its own
module, that module's pre-hook; for one read in a parent's forward
(``F.linear(x, self.head.weight)``), the last module boundary before the read
(so the resolution is a module call); for one first read by ``loss_fn``, or
never, the end of the forward pass. The timed iterations run without the
mode, which costs a Python call per operation. A model whose control flow
changes the sequence of module calls between passes gets the nearest event by
count; past the last one, the end of the forward pass.

[Note: a module's backward time] Full backward hooks
(``register_full_backward_hook``) wrap a module's inputs and outputs in an
autograd function, which changes the graph and refuses outputs modified in
place later (``nn.ReLU(inplace=True)`` after a convolution, as in torchvision's
ResNet). So instead, when a leaf module's forward returns, the autograd nodes
it created (those reachable from its outputs and younger than its call, by
their sequence number) get a pre-hook and a hook; a module's backward time is
the sum of its nodes' times. The graph and the gradients are unchanged.

[Note: timing on an accelerator] Kernels run asynchronously, so every time
point (each module event, each gradient hook, the ends of the passes and of
the optimizer step) synchronizes the device first. That slows the profiled
iterations a little (one synchronization per module call) but makes every
interval the device's time, not the time the host took to queue it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import UninitializedParameter
from torch.utils._pytree import tree_leaves

from commsched.profiling.profile import ModuleProfile, ParameterProfile, Profile
from commsched.watch.parameter_use import ParameterUseMode

_NO_SEQUENCE = 2**63
"""Autograd nodes at or above this sequence number (AccumulateGrad) belong to no module call."""


def profile_model(
    model: nn.Module,
    make_batch: Callable[[], tuple],
    loss_fn: Callable[..., torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    iterations: int = 5,
    warmup: int = 2,
    name: str = "model",
    *,
    batch_size: int | None = None,
) -> Profile:
    """Train ``model`` for ``warmup + iterations`` iterations here and return the medians of the last ones.

    ``make_batch()`` returns ``(inputs, *loss_args)``: the model is called as
    ``model(inputs)`` (``model(*inputs)`` for a tuple, ``model(**inputs)`` for a
    dict) and the loss is ``loss_fn(output, *loss_args)``. ``optimizer``
    defaults to SGD (lr 0.01, momentum 0.9) over the trainable parameters; its
    ``step()`` is timed as ``update_s``. Only parameters with
    ``requires_grad`` are profiled, in ``named_parameters()`` order. The model
    really trains (pass a copy if its weights matter); every hook is removed
    afterwards; lazy modules are initialised by one call without gradients
    first. ``batch_size`` defaults to the first dimension of the first input
    tensor. See [Note: when a parameter is first read], [Note: a
    module's backward time] and [Note: timing on an accelerator].
    """
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be an integer >= 1, got {iterations!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    first = as_batch(make_batch())
    if any(isinstance(p, UninitializedParameter) for p in model.parameters()):
        with torch.no_grad():  # lazy modules take their shapes from a first call
            call_model(model, first[0])
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(f"{name} has no trainable parameters (every parameter has requires_grad=False)")
    device = named[0][1].device
    if optimizer is None:
        optimizer = torch.optim.SGD([p for _, p in named], lr=0.01, momentum=0.9)
    recorder = _Recorder(model, [p for _, p in named], clock(device))
    try:
        recorder.discover(lambda: loss_fn(call_model(model, first[0]), *first[1:]))
        measured: list[_Iteration] = []
        for index in range(warmup + iterations):
            batch = first if index == 0 else as_batch(make_batch())
            sample = recorder.iteration(model, batch, loss_fn, optimizer)
            if index >= warmup:
                measured.append(sample)
    finally:
        recorder.remove()
    return Profile(
        model=name,
        device=str(device),
        batch_size=batch_size if batch_size is not None else _batch_size(first[0]),
        forward_s=statistics.median(s.forward_s for s in measured),
        backward_s=statistics.median(s.backward_s for s in measured),
        update_s=statistics.median(s.update_s for s in measured),
        parameters=tuple(
            ParameterProfile(
                name=param_name,
                numel=param.numel(),
                element_size=param.element_size(),
                first_use_s=statistics.median(s.first_use_s[i] for s in measured),
                ready_s=statistics.median(s.ready_s[i] for s in measured),
            )
            for i, (param_name, param) in enumerate(named)
        ),
        modules=recorder.module_profiles(measured),
    )


@dataclasses.dataclass
class _Iteration:
    forward_s: float
    backward_s: float
    update_s: float
    first_use_s: list[float]
    ready_s: list[float]
    module_forward_s: dict[str, float]
    module_backward_s: dict[str, float]


class _Recorder:
    """The hooks of one `profile_model` call, and what they saw in the current iteration."""

    def __init__(self, model: nn.Module, params: Sequence[nn.Parameter], now: Callable[[], float]):
        self._now = now
        self._slot_of = {id(p): i for i, p in enumerate(params)}
        self._num_slots = len(params)
        self._first_event: dict[int, int] = {}
        """Per slot: how many events had happened when the forward pass first read it (discovery pass)."""
        self._leaf_names: dict[int, str] = {}
        self._in_forward = False
        self._backward_start = 0.0
        self._events: list[float] = []
        self._ready: list[float | None] = []
        self._starts: dict[int, tuple[float, int]] = {}
        self._module_forward: dict[str, float] = {}
        self._module_backward: dict[str, float] = {}
        self._handles: list[Any] = []
        for module_name, module in model.named_modules():
            leaf = next(module.children(), None) is None
            if leaf:
                self._leaf_names[id(module)] = module_name or type(module).__name__
            self._handles.append(module.register_forward_pre_hook(self._before_module))
            self._handles.append(module.register_forward_hook(self._after_module))
        for slot, param in enumerate(params):
            self._handles.append(param.register_post_accumulate_grad_hook(self._ready_hook(slot)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ----------------------------------------------------------- forward hooks
    def _before_module(self, module: nn.Module, args: object) -> None:
        if not self._in_forward:
            return  # e.g. a forward re-run during backward (activation checkpointing)
        now = self._now()
        self._events.append(now)
        if id(module) in self._leaf_names:
            self._starts[id(module)] = (now, _next_sequence_nr())

    def _after_module(self, module: nn.Module, args: object, output: object) -> None:
        if not self._in_forward:
            return
        now = self._now()
        self._events.append(now)
        name = self._leaf_names.get(id(module))
        start = self._starts.pop(id(module), None)
        if name is None or start is None:
            return
        self._module_forward[name] = self._module_forward.get(name, 0.0) + now - start[0]
        for node in _nodes_created_since(output, start[1]):
            self._time_node(node, name)

    def _time_node(self, node: torch.autograd.graph.Node, module_name: str) -> None:
        began = [0.0]

        def before(grad_outputs: object) -> None:
            began[0] = self._now()

        def after(grad_inputs: object, grad_outputs: object) -> None:
            self._module_backward[module_name] = (
                self._module_backward.get(module_name, 0.0) + self._now() - began[0]
            )

        node.register_prehook(before)
        node.register_hook(after)

    def _ready_hook(self, slot: int) -> Callable[[torch.Tensor], None]:
        def ready(param: torch.Tensor) -> None:
            if self._ready and self._ready[slot] is None:
                self._ready[slot] = self._now() - self._backward_start

        return ready

    # ------------------------------------------------------------------ passes
    def discover(self, forward_and_loss: Callable[[], object]) -> None:
        """One untimed forward pass (and loss) that notes when each parameter is first read."""

        def note(param: nn.Parameter) -> None:
            slot = self._slot_of.get(id(param))
            if slot is not None and slot not in self._first_event:
                self._first_event[slot] = len(self._events)

        self._begin_forward()
        try:
            with ParameterUseMode(note):
                forward_and_loss()
        finally:
            self._in_forward = False

    def _begin_forward(self) -> float:
        self._events, self._starts = [], {}
        self._module_forward, self._module_backward = {}, {}
        self._ready = [None] * self._num_slots
        start = self._now()
        self._in_forward = True
        return start

    def iteration(
        self,
        model: nn.Module,
        batch: tuple,
        loss_fn: Callable[..., torch.Tensor],
        optimizer: torch.optim.Optimizer,
    ) -> _Iteration:
        optimizer.zero_grad(set_to_none=True)
        start = self._begin_forward()
        try:
            loss = loss_fn(call_model(model, batch[0]), *batch[1:])
        finally:
            self._in_forward = False
        self._backward_start = self._now()
        forward_s = self._backward_start - start
        loss.backward()
        backward_end = self._now() - self._backward_start
        step_start = self._now()
        optimizer.step()
        update_s = self._now() - step_start
        ready = [backward_end if r is None else r for r in self._ready]
        self._ready = []
        events = [t - start for t in self._events]
        return _Iteration(
            forward_s=forward_s,
            backward_s=max(ready),
            update_s=update_s,
            first_use_s=[self._first_use(slot, events, forward_s) for slot in range(self._num_slots)],
            ready_s=ready,
            module_forward_s=self._module_forward,
            module_backward_s=self._module_backward,
        )

    def _first_use(self, slot: int, events: list[float], forward_s: float) -> float:
        count = self._first_event.get(slot)
        if count is None or count > len(events):
            return forward_s
        return events[count - 1] if count > 0 else 0.0

    def module_profiles(self, measured: Sequence[_Iteration]) -> tuple[ModuleProfile, ...]:
        """Leaf modules that ran, in ``named_modules()`` order, with their median own times."""
        ran = {name for sample in measured for name in sample.module_forward_s}
        return tuple(
            ModuleProfile(
                name=name,
                forward_s=statistics.median(s.module_forward_s.get(name, 0.0) for s in measured),
                backward_s=statistics.median(s.module_backward_s.get(name, 0.0) for s in measured),
            )
            for name in self._leaf_names.values() if name in ran
        )


def _next_sequence_nr() -> int:
    """The sequence number the next autograd node made on this thread will get (numbers only grow)."""
    with torch.enable_grad():
        node = torch.empty(0, requires_grad=True).view(0).grad_fn
    return node._sequence_nr() + 1


def _nodes_created_since(output: object, sequence_nr: int) -> list[torch.autograd.graph.Node]:
    """The autograd nodes reachable from ``output`` made since ``sequence_nr``: one module call's own."""
    found: dict[int, torch.autograd.graph.Node] = {}
    stack = [t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in found:
            continue
        number = node._sequence_nr()
        if number < sequence_nr or number >= _NO_SEQUENCE:
            continue
        found[id(node)] = node
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(found.values())


def as_batch(batch: object) -> tuple:
    if isinstance(batch, (tuple, list)) and batch:
        return tuple(batch)
    return (batch,)


def call_model(model: nn.Module, inputs: object) -> object:
    if isinstance(inputs, tuple):
        return model(*inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(inputs)


def _batch_size(inputs: object) -> int:
    for leaf in tree_leaves(inputs):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 1


def clock(device: torch.device) -> Callable[[], float]:
    """``time.perf_counter`` after the device's queued work is done; see [Note: timing on an accelerator]."""
    backend = getattr(torch, device.type, None) if device.type != "cpu" else None
    synchronize = getattr(backend, "synchronize", None)
    if synchronize is None:
        return time.perf_counter
    if device.type == "cuda":
        def cuda_now() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return cuda_now

    def now() -> float:
        synchronize()
        return time.perf_counter()

    return now


def scaled_compute(profile: Profile, factor: float) -> Profile:
    """``profile`` with every compute time multiplied by ``factor`` (the link unchanged).

    ``factor=0.02`` asks what the schedule would be on a device 50 times
    faster than the one profiled: forward, backward and update times, each
    parameter's first read and gradient time, and each module's times scale
    together, so the shape of the timeline stays.
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"the compute scale must be a finite number > 0, got {factor!r}")
    return dataclasses.replace(
        profile,
        forward_s=profile.forward_s * factor,
        backward_s=profile.backward_s * factor,
        update_s=profile.update_s * factor,
        parameters=tuple(
            dataclasses.replace(p, first_use_s=p.first_use_s * factor, ready_s=p.ready_s * factor)
            for p in profile.parameters
        ),
        modules=tuple(
            dataclasses.replace(m, forward_s=m.forward_s * factor, backward_s=m.backward_s * factor)
            for m in profile.modules
        ),
    )
