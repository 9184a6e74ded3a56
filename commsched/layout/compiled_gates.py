"""The compiled regions of a prepared model, and how their forward gates reach their compiled code.

A compiled region is a ``torch.compile(module)`` wrapper, or a module compiled in place by
``module.compile()``. With forward overlap, each region compiles from then on through
`commsched.layout.gated_graphs.GatesInGraphs` around the backend it was compiled with (its
``fullgraph`` and ``dynamic`` kept): its graphs wait for their buckets piece by piece, and the module
gates inside it break no graph ([Note: gates in compiled graphs]). `GatedRegions.restore` gives the
regions their own compiled calls back when the model is released.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from commsched.layout.gated_graphs import calling_gated_region

logger = logging.getLogger("commsched")

MakeBackend = Callable[[Callable[..., Any]], Callable[..., Any]]
"""The region's own backend -> the backend it compiles through while prepared."""


def compiled(module: nn.Module) -> bool:
    """Whether ``module``'s calls run compiled code: a ``torch.compile`` wrapper, or compiled in place."""
    return _is_wrapper(module) or getattr(module, "_compiled_call_impl", None) is not None


def _is_wrapper(module: nn.Module) -> bool:
    """A ``torch.compile(module)`` wrapper (``OptimizedModule``), without importing dynamo where it is not."""
    return hasattr(module, "_orig_mod") and hasattr(module, "dynamo_ctx")


def _in_place_context(module: nn.Module) -> Any:
    """The dynamo context of ``module.compile()``: its compiled call holds it."""
    call = module._compiled_call_impl
    cells = getattr(call, "__closure__", None) or ()
    for cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if hasattr(value, "callback") and hasattr(value, "fullgraph"):
            return value
    return None


def outermost_compiled(root: nn.Module) -> Iterator[nn.Module]:
    """The compiled regions of ``root``: compiled modules not inside another."""
    stack = [root]
    while stack:
        module = stack.pop()
        if compiled(module):
            yield module
        else:
            stack.extend(reversed(list(module.children())))


class GatedRegions:
    """``root``'s compiled regions, compiling through the backend ``make_backend`` gives each."""

    def __init__(self, root: nn.Module, make_backend: MakeBackend):
        self._restore: list[Callable[[], None]] = []
        for region in outermost_compiled(root):
            undo = _gate_wrapper(region, make_backend) if _is_wrapper(region) else _gate_in_place(region, make_backend)
            if undo is None:
                name = next((n for n, m in root.named_modules() if m is region), "") or type(region).__name__
                raise ValueError(
                    f"commsched: the compiled module '{name}' holds no dynamo context commsched can read, so its "
                    "graphs cannot wait for their buckets. Compile it with torch.compile(module) or "
                    "module.compile(), or prepare with commsched.Strategy(overlap_forward=False)")
            self._restore.append(undo)

    @property
    def count(self) -> int:
        return len(self._restore)

    def restore(self) -> None:
        """Each region compiles with its own backend again (graphs compiled through commsched's are dropped
        by dynamo's backend guard)."""
        for undo in reversed(self._restore):
            undo()
        self._restore.clear()


def _recompiled(fn: Callable[..., Any], context: Any, make_backend: MakeBackend) -> Any:
    import torch
    from torch._dynamo.eval_frame import innermost_backend

    backend = make_backend(innermost_backend(context.callback))
    return torch.compile(fn, backend=backend, fullgraph=context.fullgraph, dynamic=context._dynamic)


def _gate_wrapper(region: nn.Module, make_backend: MakeBackend) -> Callable[[], None] | None:
    original = region.dynamo_ctx
    if not hasattr(original, "callback"):
        return None
    region.dynamo_ctx = _recompiled(region._orig_mod, original, make_backend).dynamo_ctx
    region._initialize()
    attribute = "_forward" if hasattr(region._orig_mod, "_initialize_hook") else "forward"
    setattr(region, attribute, calling_gated_region(getattr(region, attribute)))

    def undo() -> None:
        region.dynamo_ctx = original
        region._initialize()

    return undo


def _gate_in_place(region: nn.Module, make_backend: MakeBackend) -> Callable[[], None] | None:
    context = _in_place_context(region)
    if context is None:
        return None
    original = region._compiled_call_impl
    region._compiled_call_impl = calling_gated_region(_recompiled(region._call_impl, context, make_backend))

    def undo() -> None:
        region._compiled_call_impl = original

    return undo


def see_gates_when_compiled(root: nn.Module) -> None:
    """[Note: dynamo and module hooks] Dynamo skips guards on module hooks by default, so a graph compiled
    before the gates were installed (for a plain copy, or for this model during warm-up, whose forward
    passes run eagerly) would run without them: dynamo guards on hooks from now on, and the code of
    ``root``'s compiled regions is compiled afresh."""
    regions = list(outermost_compiled(root))
    if not regions:
        return
    import torch._dynamo
    from torch._C._dynamo.eval_frame import reset_code

    if torch._dynamo.config.skip_nnmodule_hook_guards:
        logger.info("commsched: dynamo guards on module hooks from now on (torch._dynamo.config."
                    "skip_nnmodule_hook_guards = False), so that compiled code runs the forward gates")
        torch._dynamo.config.skip_nnmodule_hook_guards = False
    codes = {nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__}
    for region in regions:
        for module in region.modules():
            forward = getattr(type(module), "forward", None)
            if hasattr(forward, "__code__"):
                codes.add(forward.__code__)
    for code in codes:
        reset_code(code)
