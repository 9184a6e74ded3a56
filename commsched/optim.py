"""What a prepared optimizer gains: steps on averaged gradients, and ``synchronize()``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from commsched.reducer import GradientReducer


class CommschedOptimizer:
    """Mixed into the class of a prepared optimizer (the optimizer object itself is kept).

    ``isinstance(opt, torch.optim.SGD)`` still holds, ``param_groups``, state and
    checkpoints keep torch.optim's format, and LR schedulers work unchanged.
    """

    _commsched_reducer: GradientReducer

    def synchronize(self) -> None:
        """Block until every pending gradient reduction (and update) is done."""
        self._commsched_reducer.synchronize()

    def step(self, closure: Any = None) -> Any:
        """Release this iteration's update.

        Without forward overlap the update runs now; with it, ``step()`` returns at
        once and each bucket is updated when its reduction completes.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._commsched_reducer.step(super(CommschedOptimizer, self).step)  # type: ignore[misc]
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._commsched_reducer.before_zero_grad(set_to_none)
        super().zero_grad(set_to_none)  # type: ignore[misc]

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state dict; with parameter servers, their state is fetched first."""
        self._commsched_reducer.before_optimizer_state_dict()
        return super().state_dict()  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as torch.optim does; with parameter servers, the state is sent to them too."""
        self.synchronize()
        super().load_state_dict(state_dict)  # type: ignore[misc]
        self._commsched_reducer.after_optimizer_load()
