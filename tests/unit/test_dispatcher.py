"""The dispatcher's credit, with handles whose completion the test decides.

Real gloo operations are in tests/distributed/test_dispatch.py; here a handle may
complete before its callback is attached, a window too short to hit on purpose there.
"""

from __future__ import annotations

from collections.abc import Callable

from commsched.engine.completion import CallbackTracker
from commsched.engine.dispatch import Dispatcher
from commsched.layout.partitions import Partition, Plan, make_partitions


class DoneBeforeItsCallback:
    """An operation that finished before its callback was attached: the callback runs at
    once, while ``is_completed()`` still says False, as torch's work does until its
    callbacks have run."""

    def wait(self, timeout_s: float) -> None:
        return None

    def is_completed(self) -> bool:
        return False

    def on_complete(self, callback: Callable[[], None]) -> None:
        callback()


def test_a_partition_done_before_its_callback_still_returns_its_credit():
    partitions = make_partitions([256, 256], [4, 4], [9, 0], 1024)  # one partition per bucket
    launched: list[int] = []

    def launch(partition: Partition) -> DoneBeforeItsCallback:
        launched.append(partition.pid)
        return DoneBeforeItsCallback()

    dispatcher = Dispatcher(Plan(tuple(partitions), (0, 1), credit_bytes=1024), launch, CallbackTracker(),
                            credit_from_completions=True)
    dispatcher.bucket_ready(1)  # 1 waits behind 0 in the plan
    dispatcher.bucket_ready(0)  # 0 goes, completes at once, and its credit lets 1 go
    assert launched == [0, 1]


class EnqueuedNotDone:
    """An NCCL work as the dispatcher sees it: its future's callback runs as it is enqueued, and
    only ``is_completed()`` says when it is done (the test decides)."""

    def __init__(self) -> None:
        self.done = False

    def wait(self, timeout_s: float) -> None:
        return None

    def is_completed(self) -> bool:
        return self.done

    def on_complete(self, callback: Callable[[], None]) -> None:
        callback()


def test_credit_returns_only_on_completion_where_callbacks_fire_at_enqueue():
    partitions = make_partitions([256, 256, 256], [4, 4, 4], [0, 1, 2], 1024)  # one partition each
    handles: dict[int, EnqueuedNotDone] = {}
    seen: list[int] = []

    def launch(partition: Partition) -> EnqueuedNotDone:
        handles[partition.pid] = EnqueuedNotDone()
        return handles[partition.pid]

    dispatcher = Dispatcher(Plan(tuple(partitions), (0, 1, 2), credit_bytes=1024), launch, CallbackTracker(),
                            credit_from_completions=False, seen_complete=lambda p, h: seen.append(p.pid))
    dispatcher.bucket_ready(0)
    dispatcher.bucket_ready(1)
    dispatcher.bucket_ready(2)
    assert list(handles) == [0], "a callback that ran at enqueue returned credit"
    handles[0].done = True
    dispatcher.poll()  # a gate: partition 0 is found complete, and leaves the window
    assert seen == [0] and list(handles) == [0], "a poll issues nothing"
    dispatcher.bucket_ready(2)  # the next dispatch point issues what the window now lets go
    assert list(handles) == [0, 1]
    handles[1].done = True
    dispatcher.issue_remaining()
    assert list(handles) == [0, 1, 2] and seen == [0, 1]


def test_credit_from_callbacks_where_they_fire_on_completion():
    """The same with gloo's semantics: a completion's callback returns the credit at once."""
    partitions = make_partitions([256, 256], [4, 4], [0, 1], 1024)
    callbacks: list[Callable[[], None]] = []
    launched: list[int] = []

    class Later(EnqueuedNotDone):
        def on_complete(self, callback: Callable[[], None]) -> None:
            callbacks.append(callback)

    def launch(partition: Partition) -> Later:
        launched.append(partition.pid)
        return Later()

    dispatcher = Dispatcher(Plan(tuple(partitions), (0, 1), credit_bytes=1024), launch, CallbackTracker(),
                            credit_from_completions=True)
    dispatcher.bucket_ready(0)
    dispatcher.bucket_ready(1)
    assert launched == [0]
    callbacks[0]()  # on gloo's thread: 0 is done
    assert launched == [0, 1]
