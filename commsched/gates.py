"""Forward gates: with forward overlap, each module waits only for its own parameters.

A gate is a forward pre-hook on every module that owns parameters (and one on
the root for parameters used before their module runs). It asks the current
backward pass to finish its buckets: wait for their reductions, then run the
updates ``step()`` released. The CPU waits on the handle; modules whose
buckets are done pass straight through. A recomputation during backward
(activation checkpointing) passes straight through too: see
[Note: recomputation] in `commsched.autograd_context`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from commsched.autograd_context import running_backward
from commsched.layout import GradLayout

WaitForBuckets = Callable[[Sequence[int]], None]


class ForwardGates:
    """Installs one forward pre-hook per gated module; `remove` takes them off."""

    def __init__(self, root: torch.nn.Module, layout: GradLayout, wait_for: WaitForBuckets):
        self._handles: list[RemovableHandle] = []
        for module, buckets in layout.gated_modules:
            self._handles.append(module.register_forward_pre_hook(_gate(buckets, wait_for)))
        if layout.root_buckets:
            # Registered after the root's own pre-hook (checks, buffer broadcast), so it runs after it.
            self._handles.append(root.register_forward_pre_hook(_gate(layout.root_buckets, wait_for)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _gate(buckets: Sequence[int], wait_for: WaitForBuckets):
    def gate(module: torch.nn.Module, args: object) -> None:
        if not running_backward():
            wait_for(buckets)

    return gate
