"""What the first forward pass reveals: module order, and parameters used early.

Priority needs the *forward execution order* (registration order is wrong for
many models: a parameter registered on a container, a head defined before its
body). Forward overlap needs to know which parameters are used before their
owning module runs (``F.linear(x, self.head.weight)`` in a parent's forward,
or ``nn.MultiheadAttention``'s ``out_proj``, whose module never runs): such a
parameter is not protected by its owner's gate, so its bucket is waited for by
the gate of the innermost module that was running when it was read (the
parent; the attention module), and the order puts it where that module runs,
so that its gradient shares that module's bucket and priority. Waiting for it
at the start of the forward pass instead would put every attention layer's
``out_proj`` in one bucket ready only when the backward pass ends, and make the
next forward pass wait for its reduction before the first layer.

Both are recorded once, during the first forward pass that records gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from commsched.errors import wait_or_raise
from commsched.watch.parameter_use import ParameterUseMode


class ForwardRecorder:
    """Attach before the first forward pass; `finish()` after it."""

    def __init__(self, root: torch.nn.Module, params: Sequence[torch.nn.Parameter]):
        self._root = root
        self._slot_of = {id(p): slot for slot, p in enumerate(params)}
        self._owners: dict[int, list[torch.nn.Module]] = {}
        for module in root.modules():
            for param in module._parameters.values():
                if param is not None and id(param) in self._slot_of:
                    self._owners.setdefault(id(param), []).append(module)
        self._entered: set[int] = set()
        self._running: list[torch.nn.Module] = []
        """Modules whose forward is running, innermost last."""
        self.module_order: list[torch.nn.Module] = []
        self.read_by: dict[int, torch.nn.Module] = {}
        """Per slot used before its owner ran: the innermost module running when it was
        first read, in the order of first use. Its gate waits for the slot's bucket."""
        # Attached from inside the root's own pre-hook, so the root's recording
        # hook would only run from the next call on: enter the root by hand.
        self._on_module_forward(root, ())
        self._handles = [m.register_forward_pre_hook(self._on_module_forward) for m in root.modules()]
        self._handles += [m.register_forward_hook(self._on_module_return, always_call=True) for m in root.modules()]
        self._mode = ParameterUseMode(self.note_use)
        self._mode.__enter__()

    def _on_module_forward(self, module: torch.nn.Module, args: object) -> None:
        self._running.append(module)
        if id(module) not in self._entered:
            self._entered.add(id(module))
            self.module_order.append(module)

    def _on_module_return(self, module: torch.nn.Module, args: object, output: object) -> None:
        if self._running and self._running[-1] is module:
            self._running.pop()

    def note_use(self, param: torch.nn.Parameter) -> None:
        slot = self._slot_of.get(id(param))
        if slot is None or slot in self.read_by:
            return
        if not any(id(owner) in self._entered for owner in self._owners.get(id(param), ())):
            self.read_by[slot] = self._running[-1] if self._running else self._root

    def finish(self) -> None:
        self._mode.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def parameter_order(self, params: Sequence[torch.nn.Parameter]) -> list[int]:
        """Slots in the order of their module's first forward call: each module's
        own, then those it read before their owner ran (in order of use); then
        those whose modules never ran and were not used, in registration order.

        A parameter used before its owner is waited for by the module that read it
        (see the module's docstring): ordered where its owner runs, or last when
        its owner never runs, its bucket's priority would not match that wait.
        """
        read_by = slots_by_reader(self.read_by)
        order: list[int] = []
        placed: set[int] = set(self.read_by)
        for module in self.module_order:
            for param in module._parameters.values():
                slot = None if param is None else self._slot_of.get(id(param))
                if slot is not None and slot not in placed:
                    placed.add(slot)
                    order.append(slot)
            order.extend(read_by.get(id(module), ()))
        order.extend(slot for slot in range(len(params)) if slot not in placed)
        return order


class FirstForward:
    """Records one forward pass and hands what it saw to ``done(order, read_by)``.

    Started from the root's forward pre-hook; ``done`` runs when that forward
    returns, or raises (then with whatever was seen).
    """

    def __init__(
        self,
        root: torch.nn.Module,
        params: Sequence[torch.nn.Parameter],
        done: Callable[[list[int], dict[int, torch.nn.Module]], None],
    ):
        self._params, self._done = params, done
        self._recorder = ForwardRecorder(root, params)
        self._handle = root.register_forward_hook(self._after, always_call=True)

    def _after(self, module: torch.nn.Module, args: object, output: object) -> None:
        self._handle.remove()
        self._recorder.finish()
        self._done(self._recorder.parameter_order(self._params), self._recorder.read_by)


def slots_by_reader(read_before_owner: dict[int, torch.nn.Module]) -> dict[int, list[int]]:
    """Per reading module (by ``id``), the slots it read before their own module ran, in order of first read."""
    by_reader: dict[int, list[int]] = {}
    for slot, module in read_before_owner.items():
        by_reader.setdefault(id(module), []).append(slot)
    return by_reader


def agree_on_order(order: list[int], group: dist.ProcessGroup, timeout_s: float) -> list[int]:
    """Rank 0's order on every rank (ranks may see different control flow).

    A peer that never joins raises `CommunicationTimeout` after ``timeout_s``.
    """
    if dist.get_world_size(group) == 1:
        return order
    tensor = torch.tensor(order, dtype=torch.int64)
    work = dist.broadcast(tensor, group=group, group_src=0, async_op=True)
    wait_or_raise(work, timeout_s, "the agreement on the parameter order (first forward pass)")
    return tensor.tolist()
