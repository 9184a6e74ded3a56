"""The one place tests reach past `commsched.status` into a prepared model's engine, for what a
snapshot cannot say: an object's lifetime, and the calls made in the order they were made.

Everything else a test checks about a prepared model comes from ``commsched.status(model)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from commsched.engine.reducer import GradientReducer


def reducer_of(model: torch.nn.Module) -> GradientReducer:
    """The engine object behind a model returned by ``commsched.prepare()`` (its buckets, plan and
    transport): for a test that holds a weak reference to it, which must die with the model."""
    return model._commsched_reducer


def record_updates(model: torch.nn.Module, updated: list[int],
                   after: Callable[[int], None] | None = None) -> None:
    """From now on, append to ``updated`` each bucket the model's update policy updates, as the
    update starts, in the order they start; ``after(bucket)`` runs once each update returns."""
    policy = reducer_of(model).policy
    update = policy.update

    def recorded(bucket: int, *args):
        updated.append(bucket)
        result = update(bucket, *args)
        if after is not None:
            after(bucket)
        return result

    policy.update = recorded
