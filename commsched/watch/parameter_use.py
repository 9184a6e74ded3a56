"""A torch-function mode that reports every parameter a torch function receives.

Used where commsched must learn, once, which parameters code touches: the first
forward pass (`commsched.watch.first_forward`) and the stretch of the loop outside it
(`commsched.watch.reads`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves


def _always(func: object) -> bool:
    return True


class ParameterUseMode(TorchFunctionMode):
    """Calls ``note(param)`` for each ``nn.Parameter`` among a call's arguments, when ``watching(func)``."""

    def __init__(
        self, note: Callable[[torch.nn.Parameter], None], watching: Callable[[object], bool] = _always
    ):
        super().__init__()
        self._note, self._watching = note, watching

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._watching(func):
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.nn.Parameter):
                    self._note(leaf)
        return func(*args, **kwargs)
