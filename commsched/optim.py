"""What a prepared optimizer gains: steps on averaged gradients, and ``synchronize()``."""

from __future__ import annotations

from typing import Any

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
        self.synchronize()
        return super().step(closure)  # type: ignore[misc]

    def state_dict(self) -> dict[str, Any]:
        self.synchronize()
        return super().state_dict()  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.synchronize()
        super().load_state_dict(state_dict)  # type: ignore[misc]
