"""The dispatcher on real gloo operations: what a completion lets go, and when.

The plans here are built by hand, so that each case knows which partition may go
when; the operations are real all-reduces between two ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from commsched.engine.completion import CallbackTracker
from commsched.engine.dispatch import Dispatcher
from commsched.errors import wait_or_raise
from commsched.layout.partitions import Partition, Plan, make_partitions
from commsched.testing import run_subtests

pytestmark = pytest.mark.distributed

TIMEOUT_S = 30.0


class GlooHandle:
    """A real all-reduce's `Work`, seen through the `Handle` protocol."""

    def __init__(self, work: dist.Work):
        self.work = work

    def wait(self, timeout_s: float) -> None:
        wait_or_raise(self.work, timeout_s, "an all-reduce of the dispatch test")

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def on_complete(self, callback: Callable[[], None]) -> None:
        self.work.get_future().add_done_callback(lambda future: callback())


class Wire:
    """Launches each partition as an all-reduce of its own tensor and records the order."""

    def __init__(self, partitions: list[Partition]):
        self.tensors = [torch.ones(p.nbytes // 4) for p in partitions]
        self.launched: list[int] = []
        self.handles: dict[int, GlooHandle] = {}
        self.in_flight_at_launch: dict[int, list[int]] = {}
        """For each partition, those launched before it whose operation had not finished.

        Read from the future, which is done before its callbacks run (the work's
        ``is_completed()`` is not): a partition launched from its predecessor's
        callback sees that predecessor finished."""

    def launch(self, partition: Partition) -> GlooHandle:
        self.in_flight_at_launch[partition.pid] = [
            pid for pid, handle in self.handles.items() if not handle.work.get_future().done()]
        self.launched.append(partition.pid)
        handle = GlooHandle(dist.all_reduce(self.tensors[partition.pid], async_op=True))
        self.handles[partition.pid] = handle
        return handle


PARTITION_BYTES = 2**20
"""Large enough that no all-reduce completes before its callback is attached (a callback
that runs at once, inside the pump, issues nothing)."""


def dispatcher_for(order: tuple[int, ...], credit_bytes: int | None) -> tuple[Dispatcher, Wire, CallbackTracker]:
    # bucket 0 (output side, priority 9) in two partitions, bucket 1 (input side, priority 0) in one
    partitions = make_partitions([2 * PARTITION_BYTES // 4, PARTITION_BYTES // 4], [4, 4], [9, 0], PARTITION_BYTES)
    wire, tracker = Wire(partitions), CallbackTracker()
    plan = Plan(tuple(partitions), order, credit_bytes, agreed=True)
    dispatcher = Dispatcher(plan, wire.launch, tracker, credit_from_completions=credit_bytes is not None)
    return dispatcher, wire, tracker


def end_backward(dispatcher: Dispatcher) -> None:
    """What `BackwardPass.end_backward` tells the dispatcher: the input side's bucket is
    held to the end, then everything left goes."""
    dispatcher.end_backward()
    dispatcher.bucket_ready(1)
    dispatcher.issue_remaining()


def wait_all(wire: Wire, tracker: CallbackTracker) -> None:
    for handle in wire.handles.values():
        handle.wait(TIMEOUT_S)
    tracker.drain(TIMEOUT_S)


def case_a_completion_returns_its_own_credit():
    """Torch marks a work completed only after its callbacks ran: the callback must
    count its own partition as done, or the next one waits for another event."""
    dispatcher, wire, tracker = dispatcher_for((0, 1, 2), credit_bytes=PARTITION_BYTES)
    dispatcher.bucket_ready(0)
    tracker.drain(TIMEOUT_S)  # 0's callback ran, and issued 1; then 1's
    assert wire.launched == [0, 1]
    # the window holds one partition: 1 went only once 0 had finished (whichever thread launched it)
    assert wire.in_flight_at_launch[1] == []
    end_backward(dispatcher)
    assert wire.launched == [0, 1, 2]
    wait_all(wire, tracker)


def case_everything_goes_by_the_end_of_backward():
    """Whatever the window holds back goes when the backward pass ends, in plan order."""
    dispatcher, wire, tracker = dispatcher_for((0, 1, 2), credit_bytes=PARTITION_BYTES)
    tracker.abandon()  # completions issue nothing: only the end of backward can
    dispatcher.bucket_ready(0)
    assert wire.launched == [0]
    end_backward(dispatcher)
    assert wire.launched == [0, 1, 2]
    for handle in wire.handles.values():
        handle.wait(TIMEOUT_S)


def dispatch_cases(rank: int, world_size: int) -> None:
    run_subtests({
        "a_completion_returns_its_own_credit": case_a_completion_returns_its_own_credit,
        "everything_goes_by_the_end_of_backward": case_everything_goes_by_the_end_of_backward,
    })


def test_dispatch_on_real_operations(ranks):
    ranks(dispatch_cases, 2, timeout_s=120)
