"""Where the autograd engine is, for hooks that must tell a forward pass from a recomputation.

[Note: recomputation] Activation checkpointing (``torch.utils.checkpoint``)
runs parts of the forward pass again *during* backward, and with them every
forward pre-hook of the modules involved. Those calls are not the next
iteration's forward pass: a gate must not wait for (or mark as done) buckets
whose reductions have not even been issued, and the root must not broadcast
buffers or check the model again. Any hook that runs while the engine is
executing a graph task is such a recomputation; the engine knows it per thread.

[Note: nested backward] Reentrant checkpointing (``use_reentrant=True``)
computes a block's gradients in a backward pass of its own, started from
inside the outer one. A callback queued from a gradient hook belongs to the
graph task that ran the hook, so when the first gradient of an iteration comes
from such an inner pass, its end is not the end of the iteration's backward:
`inside_outer_backward` tells the two apart.
"""

from __future__ import annotations

import sys

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import _engine_run_backward

_RUN_BACKWARD = _engine_run_backward.__code__
_FUNCTION_BACKWARD = BackwardCFunction.apply.__code__


def running_backward() -> bool:
    """True inside a backward pass on this thread (so a forward call is a recomputation)."""
    return torch._C._current_graph_task_id() != -1


def inside_outer_backward() -> bool:
    """True if the backward pass running on this thread was started by an autograd
    Function's own backward, itself part of an outer backward pass that goes on."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not _RUN_BACKWARD:
        frame = frame.f_back
    while frame is not None:
        if frame.f_code is _FUNCTION_BACKWARD:
            return True
        frame = frame.f_back
    return False
