"""The hooks a prepared model carries for its whole life: thin, each calls one method of a `HookTarget`.

- per trainable parameter, a post-accumulate-grad hook: `HookTarget.gradient_ready`;
- the root's forward pre-hook: `HookTarget.before_forward`;
- the root's forward hook, which arms the first output gradient of the coming
  backward pass to call `HookTarget.backward_starting`, before any parameter's
  gradient exists (see [Note: views ahead of backward] in
  `commsched.engine.views_ahead`);
- on every module, ``state_dict()`` and ``load_state_dict()`` hooks: state read
  or loaded through any module (a backbone saved alone, the original module of
  a compiled model) waits for pending updates first, as the root's does, and a
  load is announced once, by the outermost module it started at
  (`HookTarget.state_loaded`).

With forward overlap, the forward gates too (`ForwardGates`): a forward
pre-hook on every module that owns parameters or reads others' before their
module runs (`commsched.layout.grad_layout.gating_modules`), placed by
`commsched.engine.gating` for each layout; the root's runs before any other.
Inside a compiled region the graphs wait instead, piece by piece ([Note: gates
in compiled graphs] in `commsched.layout.gated_graphs`).
A gate asks the current backward pass to finish its buckets: wait for their
reductions, then run the updates ``step()`` released. The CPU waits on the
handle; modules whose buckets are done pass straight through.

Every hook passes straight through during a recomputation in backward
(activation checkpointing): see [Note: recomputation] in
`commsched.watch.autograd_context`. Hooks of warm-up alone (the first forward
pass's recording, the reads watched) belong to the objects of warm-up.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from commsched.engine.events import phase
from commsched.layout.gated_graphs import tracing_gated_region
from commsched.watch.autograd_context import running_backward

WaitForBuckets = Callable[[Sequence[int]], None]


class HookTarget(Protocol):
    """What the hooks call: the reducer."""

    def gradient_ready(self, slot: int, param: torch.Tensor) -> None:
        """Autograd accumulated parameter ``slot``'s gradient (hot path)."""

    def before_forward(self) -> None:
        """The prepared model's forward pass begins (not a recomputation during backward)."""

    def backward_starting(self) -> None:
        """The gradient of the model's output is being computed: a backward pass through the model begins."""

    def synchronize(self) -> None:
        """Pending reductions and updates are done: state about to be read or loaded is current."""

    def state_loaded(self) -> None:
        """``load_state_dict()`` has loaded new values into the model (or part of it)."""


class ModelHooks:
    """Registers the model-long hooks on ``root`` and its ``params``; `remove` takes them off."""

    def __init__(self, root: torch.nn.Module, params: Sequence[torch.nn.Parameter], target: HookTarget):
        self._target = target
        self._handles: list[RemovableHandle] = [
            param.register_post_accumulate_grad_hook(_gradient_hook(target, slot))
            for slot, param in enumerate(params)
        ]
        self._handles.append(root.register_forward_pre_hook(self._before_forward))
        self._handles.append(root.register_forward_hook(self._arm_backward_start))
        self._loading: torch.nn.Module | None = None
        """The outermost module of the ``load_state_dict()`` under way."""
        for module in root.modules():
            self._handles.append(module.register_state_dict_pre_hook(self._before_state_dict))
            self._handles.append(module.register_load_state_dict_pre_hook(self._before_load))
            self._handles.append(module.register_load_state_dict_post_hook(self._after_load))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _before_forward(self, module: torch.nn.Module, args: object) -> None:
        if running_backward():
            return  # [Note: recomputation] in commsched.watch.autograd_context
        self._target.before_forward()

    def _arm_backward_start(self, module: torch.nn.Module, args: object, output: object) -> None:
        """The first output gradient of the coming backward pass tells the target it starts."""
        if running_backward() or not torch.is_grad_enabled():
            return
        outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outputs:
            return
        armed = [True]
        target = self._target

        def on_output_gradient(grad: torch.Tensor) -> None:
            if armed[0]:
                armed[0] = False
                target.backward_starting()

        for tensor in outputs:
            tensor.register_hook(on_output_gradient)


    def _before_state_dict(self, module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        self._target.synchronize()

    def _before_load(self, module: torch.nn.Module, state_dict: object, prefix: str, *args: object) -> None:
        """Called parent first: the first of our modules a load reaches is its outermost.

        An empty ``prefix``: ``load_state_dict()`` was called on this very module, so a load
        left unfinished by an exception is forgotten."""
        if self._loading is None or not prefix:
            self._target.synchronize()
            self._loading = module

    def _after_load(self, module: torch.nn.Module, incompatible_keys: object) -> None:
        """Called children first: the outermost module's hook comes last."""
        if module is self._loading:
            self._loading = None
            self._target.state_loaded()


def _gradient_hook(target: HookTarget, slot: int) -> Callable[[torch.Tensor], None]:
    """[Note: tensor hooks hold their target weakly] A tensor's hooks live in a dict its C++
    side holds, which the garbage collector cannot see into: a hook holding the reducer, which
    holds the parameters, made a cycle it could never break, so a model dropped without
    ``commsched.release`` kept its buckets, reducer and parameters for the rest of the process.
    Now such a model goes at a collection once its last operations have finished."""
    target_ref = weakref.ref(target)

    def on_gradient_accumulated(param: torch.Tensor) -> None:
        target = target_ref()
        if target is not None:
            target.gradient_ready(slot, param)

    return on_gradient_accumulated


class ForwardGates:
    """Installs one forward pre-hook per gated module; `remove` takes them off."""

    def __init__(
        self,
        gates_of_slots: Sequence[Sequence[torch.nn.Module]],
        bucket_of: Sequence[int],
        wait_for: WaitForBuckets,
    ):
        """``gates_of_slots``: per slot, the modules that wait for its bucket."""
        buckets_of: dict[int, tuple[torch.nn.Module, set[int]]] = {}
        for slot, modules in enumerate(gates_of_slots):
            for module in modules:
                buckets_of.setdefault(id(module), (module, set()))[1].add(bucket_of[slot])
        # The root's is registered after its own pre-hook (checks, buffer broadcast), so it runs after it.
        self._handles: list[RemovableHandle] = [
            module.register_forward_pre_hook(_gate(tuple(sorted(buckets)), wait_for))
            for module, buckets in buckets_of.values()
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _gate(buckets: Sequence[int], wait_for: WaitForBuckets):
    def wait(module: torch.nn.Module, args: object) -> None:
        if not running_backward():
            with phase("commsched::gate"):
                wait_for(buckets)

    # Elsewhere in compiled code the gate runs as it is, between two graphs: dynamo must not trace the engine.
    waits = torch.compiler.disable(wait, reason="commsched's forward gate waits for and updates buckets")

    def gate(module: torch.nn.Module, args: object) -> None:
        if tracing_gated_region():
            return  # the graph dynamo traces waits piece by piece ([Note: gates in compiled graphs])
        waits(module, args)

    return gate
