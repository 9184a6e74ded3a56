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
