"""Forward gates: with forward overlap, each module waits only for its own parameters.

A gate is a forward pre-hook on every module that owns parameters or reads
others' before their module runs (`commsched.layout.grad_layout.gating_modules`); the
root's runs before any other. It asks the current backward pass to finish its
buckets: wait for their reductions, then run the updates ``step()`` released.
The CPU waits on the handle; modules whose buckets are done pass straight
through. A recomputation during backward
(activation checkpointing) passes straight through too: see
[Note: recomputation] in `commsched.watch.autograd_context`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from commsched.engine.labels import phase
from commsched.watch.autograd_context import running_backward

WaitForBuckets = Callable[[Sequence[int]], None]


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
    def gate(module: torch.nn.Module, args: object) -> None:
        if not running_backward():
            with phase("commsched::gate"):
                wait_for(buckets)

    # In a compiled model the gate runs as it is, between two graphs: dynamo must not trace the engine.
    return torch.compiler.disable(gate, reason="commsched's forward gate waits for and updates buckets")
