"""A torch-function mode that reports every parameter a torch function receives, and what
keeps ``torch.compile`` out of its way.

Used where commsched must learn, once, which parameters code touches: the first
forward pass (`commsched.watch.first_forward`) and the stretch of the loop outside it
(`commsched.watch.reads`).

[Note: recording and torch.compile] A torch-function mode sees eager code only:
compiled code runs as graphs that never reach it, and dynamo, tracing with the mode
on the stack, traces the mode too, breaking the graph at every call and recompiling
until shapes turn dynamic. So while warm-up records, the prepared model's forward
passes run eagerly, compiled submodules included (`EagerForward`, from the root's
forward pre-hook, which ``prepare(torch.compile(model))`` runs before dynamo starts);
the model is compiled from the first forward pass after. A root compiled whole
(``model.compile()``) or after ``prepare()`` would run commsched's root hooks inside
compiled code: refused. Other compiled code that runs under the mode (a compiled
loss between two ``step()``) is not traced through it: the mode hands dynamo's calls
straight on and notes that compiled code ran (`ParameterUseMode.saw_compiled_code`),
so that its reads count as unknown ([Note: compiled reads] in `commsched.watch.reads`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle


def _always(func: object) -> bool:
    return True


class ParameterUseMode(TorchFunctionMode):
    """Calls ``note(param)`` for each ``nn.Parameter`` among a call's arguments, when ``watching(func)``."""

    def __init__(
        self, note: Callable[[torch.nn.Parameter], None], watching: Callable[[object], bool] = _always
    ):
        super().__init__()
        self._note, self._watching = note, watching
        self.saw_compiled_code = False
        """Compiled code ran under the mode: its parameters were not reported."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            # True only while dynamo traces; dynamo replays the assignment each time the compiled code runs.
            self.saw_compiled_code = True
            return func(*args, **kwargs)
        if self._watching(func):
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.nn.Parameter):
                    self._note(leaf)
        return func(*args, **kwargs)


COMPILED_WHOLE = (
    "the model given to commsched.prepare() was compiled with model.compile(), which compiles the model's "
    "whole call, commsched's hooks on it included; they must run outside the compiled code (and the first "
    "iterations eagerly, while commsched records which parameters each module uses). Prepare the compiled "
    "module instead: model, opt = commsched.prepare(torch.compile(model), opt) (its state_dict() keys start "
    "with '_orig_mod.'), or compile submodules (model.backbone.compile())"
)
COMPILED_AFTER_PREPARE = (
    "the prepared model runs inside compiled code: it was compiled after commsched.prepare() "
    "(torch.compile() of the prepared model, or model.compile() after prepare()), or a compiled function "
    "calls it (a compiled training step). commsched's hooks must run outside the compiled code, and the "
    "first iterations eagerly, while commsched records which parameters each module uses. Compile the "
    "model itself, before prepare: model, opt = commsched.prepare(torch.compile(model), opt)"
)


class EagerForward:
    """While attached, ``root``'s forward passes run eagerly, compiled submodules included.

    See [Note: recording and torch.compile]. A root compiled whole (``model.compile()``,
    whose compiled call runs the root's hooks) is refused at once; a root that runs
    inside compiled code (compiled after ``prepare()``, or called by a compiled function)
    at its first forward pass.
    """

    def __init__(self, root: torch.nn.Module):
        if root._compiled_call_impl is not None:
            raise RuntimeError(COMPILED_WHOLE)
        self._root = root
        self._stance = None
        self._depth = 0
        self._handles: list[RemovableHandle] = [
            root.register_forward_pre_hook(self._enter, prepend=True),
            root.register_forward_hook(self._leave, always_call=True),
        ]

    def _enter(self, module: torch.nn.Module, args: object) -> None:
        # Inside compiled code: while dynamo traces this hook, is_compiling() holds and the raise breaks the
        # graph; dynamo then runs the hook as it is, where set_stance() refuses to run in a compiled region.
        if self._root._compiled_call_impl is not None or torch.compiler.is_compiling():
            raise RuntimeError(COMPILED_AFTER_PREPARE)
        self._depth += 1
        if self._depth == 1 and "torch._dynamo" in sys.modules:  # nothing is compiled before it is imported
            try:
                self._stance = torch.compiler.set_stance("force_eager")
            except RuntimeError as error:  # "attempted to set_stance in a torch.compile region"
                self._depth = 0
                raise RuntimeError(COMPILED_AFTER_PREPARE) from error

    def _leave(self, module: torch.nn.Module, args: object, output: object) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0:
            self._restore_stance()

    def _restore_stance(self) -> None:
        stance, self._stance = self._stance, None
        if stance is not None:
            stance.__exit__(None, None, None)

    def detach(self) -> None:
        """The root's forward passes are compiled again from the next one on."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._depth = 0
        self._restore_stance()
