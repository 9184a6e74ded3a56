"""The interface between the reducer and whatever moves the bytes."""

from __future__ import annotations

import abc
import datetime
from collections.abc import Callable
from typing import Protocol

import torch.distributed as dist

from commsched.buckets import Bucket


class CommunicationTimeout(RuntimeError):
    """A reduction did not finish in time: a peer died, hung, or raised an error."""


def wait_or_raise(work: dist.Work, timeout_s: float, what: str) -> None:
    """Wait for ``work``; turn a failure or a timeout into `CommunicationTimeout`."""
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as error:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CommunicationTimeout(
            f"rank {rank}: {what} failed or did not finish within {timeout_s:g} s ({error}). "
            "Another rank probably died, raised an error, or runs different code; check its "
            "log. Raise Strategy.timeout_s if this legitimately takes longer."
        ) from error


class Handle(Protocol):
    """An operation in flight. It keeps its buffers alive until waited on."""

    def wait(self, timeout_s: float) -> None:
        """Block until done; raise `CommunicationTimeout` after ``timeout_s``."""

    def is_completed(self) -> bool:
        """True once the operation has finished (without blocking)."""

    def on_complete(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on any thread) once the operation has finished."""


class CompletedHandle:
    """A handle for work that needed no communication (world size 1)."""

    def wait(self, timeout_s: float) -> None:
        return None

    def is_completed(self) -> bool:
        return True

    def on_complete(self, callback: Callable[[], None]) -> None:
        callback()


class Backend(abc.ABC):
    """Launches the reduction of one bucket's flat buffer, in place."""

    world_size: int

    @abc.abstractmethod
    def launch(self, bucket: Bucket, start: int = 0, end: int | None = None) -> Handle:
        """Start summing ``bucket.flat[start:end]`` over all ranks, in place; return at once."""
