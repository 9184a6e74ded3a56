"""What a prepared model gains: ``no_sync()`` and a ``state_dict()`` that waits."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from commsched.reducer import GradientReducer


class CommschedModule:
    """Mixed into the class of a prepared model (the model object itself is kept).

    The model stays the user's own module: same attributes, same ``state_dict``
    keys, no ``.module`` indirection.
    """

    _commsched_reducer: GradientReducer

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward outside reduces them all.

        As torch DDP's ``no_sync``: run the forward and backward passes of the
        micro-batches inside the context, and the last one outside it.
        """
        with self._commsched_reducer.no_sync():
            yield

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self._commsched_reducer.synchronize()
        return super().state_dict(*args, **kwargs)  # type: ignore[misc]

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Load as torch does; with parameter servers, the new values are sent to them too."""
        self._commsched_reducer.synchronize()
        result = super().load_state_dict(*args, **kwargs)  # type: ignore[misc]
        self._commsched_reducer.after_module_load()
        return result
