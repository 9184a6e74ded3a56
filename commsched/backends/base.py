"""The interface between the reducer and whatever moves the bytes."""

from __future__ import annotations

import abc
import datetime
from collections.abc import Callable, Sequence
from typing import Protocol

import torch.distributed as dist

from commsched.buckets import Bucket
from commsched.scheduler import Partition


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
    """Moves one partition of a bucket; the reducer decides which partition goes when."""

    world_size: int
    """The number of data-parallel replicas (ranks that compute gradients)."""

    server_side_update: bool = False
    """False: `launch` averages the gradients in place and the optimizer runs here.
    True: the optimizer runs elsewhere (parameter servers) and the new values
    come back; the reducer then asks `make_updater` for the step that installs
    them, and leaves gradients as this rank computed them."""

    @property
    def is_local(self) -> bool:
        """True when nothing goes on the wire (a single replica, all-reduce)."""
        return self.world_size == 1

    @abc.abstractmethod
    def launch(self, bucket: Bucket, start: int = 0, end: int | None = None) -> Handle:
        """Start communicating ``bucket.flat[start:end]``; return at once."""

    def prepare_buckets(
        self,
        forward_order: Sequence[int],
        bucket_slots: Sequence[Sequence[int]],
        priorities: Sequence[int],
        buckets: Sequence[Bucket],
        has_grad: list[bool],
    ) -> list[Partition] | None:
        """Called once the buckets exist; return the partitions to use (None: the scheduler's)."""
        return None

    def make_updater(self):
        """With `server_side_update`: the per-bucket step that installs received values."""
        raise NotImplementedError

    def begin_iteration(self, iteration: int, new_plan: Sequence[int] | None) -> None:
        """A synchronised backward pass starts (``new_plan``: the order just agreed, if it changed)."""

    def check_hyperparameters_unchanged(self) -> None:
        """At ``step()``: raise if the update already under way used other hyper-parameters."""

    def finish(self) -> None:
        """No more iterations: release peers waiting for this rank (idempotent)."""

    def explain_failure(self, error: CommunicationTimeout) -> None:
        """A collective among the workers failed: raise a more precise error if one is known."""

    def forget_process_groups(self) -> None:
        """At exit, after `finish`: drop references to process groups (see [Note: process groups at exit])."""

    def layout_summary(self) -> str | None:
        """A readable account of where the partitions go, for logs and traces (None: nothing to say)."""
        return None

    def fetch_optimizer_state(self) -> None:
        """Before ``optimizer.state_dict()``: bring state kept elsewhere into ``optimizer.state``."""

    def push_optimizer_state(self) -> None:
        """After ``optimizer.load_state_dict()``: send the loaded state to where it is used."""

    def push_parameters(self) -> None:
        """After ``model.load_state_dict()``: send the loaded values to where they are kept."""
