"""Which parameters the training loop reads outside the forward pass, or inside it
before their gate, seen during warm-up.

[Note: reads outside the forward pass] With forward overlap, ``step()``
returns before parameters are updated and each module's gate updates its own
when the next forward pass reaches it. Code outside the forward pass that reads
parameters would see old values: a penalty computed before the forward call,
weight clipping or an EMA right after ``step()``, or, after the forward pass, a
penalty over a module that did not run. So, during the warm-up iterations
(which run without overlap), a torch-function mode notes every prepared
parameter passed to a torch function between one ``step()`` and the next,
outside the model's forward pass and outside backward. From then on:
buckets read *before* the forward pass are updated at ``step()``; buckets read
*after* it are updated when the forward pass returns. Reading metadata
(``.grad``, ``.shape``, ``size()``...) is not reading values.

[Note: reads before the gate] Inside the forward pass, each parameter is
waited for by the gates of the modules that own it, or of the module that read
it first, before its owner ran, in the *first* forward pass
(`commsched.layout.grad_layout.gating_modules`). A later pass whose control flow differs
could read it before any of those gates opened, and see old values. The same
mode checks every read of the warm-up's forward passes against the gates
entered so far in that pass; a parameter read before them is waited for by
the root's gate from then on, at the start of the forward pass. A difference
that appears only after warm-up is not seen: forward overlap assumes the
warm-up's passes are representative (``overlap_forward=False`` otherwise).

[Note: compiled reads] Code compiled by ``torch.compile`` that runs between two
``step()`` calls of warm-up, outside the model's forward pass (a compiled loss
or penalty), is not seen call by call (see [Note: recording and torch.compile]
in `commsched.watch.parameter_use`): any parameter may be read there. Every
parameter then counts as read before the forward pass, so every bucket is
updated at ``step()``: communication still overlaps the backward pass, updates
no longer overlap the next forward pass.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch.overrides import _get_current_function_mode_stack

from commsched.watch.autograd_context import running_backward
from commsched.watch.parameter_use import ParameterUseMode

logger = logging.getLogger("commsched")

_METADATA_METHODS = frozenset({
    "size", "numel", "dim", "stride", "element_size", "nelement", "is_contiguous", "data_ptr",
    "storage_offset", "get_device", "is_floating_point", "is_complex", "register_hook",
    "register_post_accumulate_grad_hook", "__len__", "__hash__", "__format__", "__repr__",
})
_VALUE_PROPERTIES = frozenset({"data"})


def _reads_values(func: object) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        return getattr(getattr(func, "__self__", None), "__name__", None) in _VALUE_PROPERTIES
    return name not in _METADATA_METHODS


class ParameterReads:
    """Records reads of prepared parameters outside the forward pass, and inside it before
    their gates, between `start` and `stop`."""

    def __init__(
        self,
        root: torch.nn.Module,
        params: Sequence[torch.nn.Parameter],
        gates_of_slots: Sequence[Sequence[torch.nn.Module]],
    ):
        """``gates_of_slots``: per slot, the modules whose gate waits for it."""
        self._root = root
        self._slot_of = {id(p): slot for slot, p in enumerate(params)}
        self._gates_of_slots = [frozenset(map(id, modules)) for modules in gates_of_slots]
        self._gate_modules = list({id(m): m for modules in gates_of_slots for m in modules}.values())
        self.before_forward: set[int] = set()
        """Slots read after ``step()`` and before the next forward pass."""
        self.after_forward: set[int] = set()
        """Slots read after the forward pass, before the next ``step()``."""
        self.before_gate: dict[int, None] = {}
        """Slots a forward pass read before any of their gates, in order of first such read."""
        self._gates_entered: set[int] = set()
        """The gates (module ids) entered so far in the running forward pass."""
        self.in_forward = False
        self._forward_ran = False
        self._mode: ParameterUseMode | None = None
        self._hooks: list = []

    @property
    def active(self) -> bool:
        return self._mode is not None

    def note(self, param: torch.nn.Parameter) -> None:
        slot = self._slot_of.get(id(param))
        if slot is None:
            return
        if not self.in_forward:
            (self.after_forward if self._forward_ran else self.before_forward).add(slot)
        elif self._gates_entered.isdisjoint(self._gates_of_slots[slot]):
            self.before_gate.setdefault(slot)

    def start(self) -> None:
        """Called at the end of ``step()``: watch until the next ``step()`` begins."""
        if self._mode is not None:
            return
        self._forward_ran = self.in_forward = False
        self._hooks = [
            self._root.register_forward_pre_hook(self._enter_forward),
            self._root.register_forward_hook(self._leave_forward, always_call=True),
        ]
        self._hooks += [m.register_forward_pre_hook(self._enter_gate) for m in self._gate_modules]
        self._mode = ParameterUseMode(self.note, self._watching)
        self._mode.__enter__()

    def stop(self) -> None:
        """Stop watching (on the thread that started it)."""
        mode = self._mode
        if mode is None:
            return
        stack = _get_current_function_mode_stack()
        if not stack or stack[-1] is not mode:
            return  # the loop entered a mode of its own meanwhile; try again at the next stop
        mode.__exit__(None, None, None)
        self._mode = None
        if mode.saw_compiled_code and len(self.before_forward) < len(self._slot_of):
            # [Note: compiled reads]
            self.before_forward.update(self._slot_of.values())
            logger.warning(
                "commsched: compiled code (torch.compile) ran between step() and the next step() during warm-up, "
                "outside the model's forward pass; commsched cannot see which parameters it reads, so every "
                "bucket is updated at step() from now on. Compile the model itself (prepare(torch.compile(model), "
                "opt)), not the code around it, to keep updates overlapping the forward pass."
            )
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _watching(self, func: object) -> bool:
        return _reads_values(func) and not running_backward()

    def _enter_forward(self, module: torch.nn.Module, args: object) -> None:
        if not running_backward():
            self.in_forward = True
            self._gates_entered = {id(module)}

    def _enter_gate(self, module: torch.nn.Module, args: object) -> None:
        self._gates_entered.add(id(module))

    def _leave_forward(self, module: torch.nn.Module, args: object, output: object) -> None:
        if not running_backward():
            self.in_forward = False
            self._forward_ran = True
