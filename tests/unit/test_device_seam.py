"""The device seam's own logic: waits that order a stream, deadlines, held objects, host waits.

The seam's stream operations run on the CPU here (torch.cpu's events and streams do nothing);
the operations it orders after are fakes the test completes (no torch.distributed: the seam
only asks them ``order``, ``is_completed`` and ``wait``). Real collectives under a recording
seam: tests/distributed/test_stream_ordering.py; on a GPU: tests/gpu.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from commsched.device import HostSeam, StreamSeam, order_after_work, seam_for, using_seam
from commsched.errors import CommunicationTimeout, communication_timeout

CPU = torch.device("cpu")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Operation:
    """A collective in flight whose completion the test decides."""

    def __init__(self, can_order: bool = True) -> None:
        self.can_order = can_order
        self.completed = False
        self.ordered = 0
        self.host_waits: list[float] = []

    def order(self) -> bool:
        self.ordered += int(self.can_order)
        return self.can_order

    def is_completed(self) -> bool:
        return self.completed

    def wait(self, timeout_s: float) -> None:
        self.host_waits.append(timeout_s)
        if not self.completed:
            raise communication_timeout("the fake operation", timeout_s, None)


class Mark:
    def __init__(self) -> None:
        self.passed = False

    def query(self) -> bool:
        return self.passed


def test_an_ordered_operation_never_makes_the_host_wait():
    seam, operation = StreamSeam(CPU, Clock()), Operation()
    seam.settle(operation, 30.0, "the reduction of gradient bucket 3")
    seam.check()
    assert operation.ordered == 1 and operation.host_waits == [] and seam.host_waits == 0


def test_an_ordered_operation_past_its_deadline_raises_at_the_next_check():
    clock = Clock()
    seam, operation = StreamSeam(CPU, clock), Operation()
    seam.settle(operation, 30.0, "the reduction of gradient bucket 3")
    clock.now += 29.0
    seam.check()  # not yet
    clock.now += 2.0
    with pytest.raises(CommunicationTimeout, match=r"the reduction of gradient bucket 3 failed or did not finish "
                                                   r"within 30 s"):
        seam.check()
    seam.check()  # said once


def test_a_completed_operation_leaves_the_watch():
    clock = Clock()
    seam, first, second = StreamSeam(CPU, clock), Operation(), Operation()
    seam.settle(first, 30.0, "first")
    seam.settle(second, 30.0, "second")
    first.completed = second.completed = True
    clock.now += 60.0
    seam.check()
    seam.wait_all(30.0)
    assert first.host_waits == second.host_waits == []


def test_the_oldest_incomplete_operation_is_named():
    clock = Clock()
    seam, first, second = StreamSeam(CPU, clock), Operation(), Operation()
    seam.settle(first, 30.0, "first")
    clock.now += 10.0
    seam.settle(second, 30.0, "second")
    first.completed = True
    clock.now += 25.0
    seam.check()  # first is done, second has 5 s left
    clock.now += 6.0
    with pytest.raises(CommunicationTimeout, match="second"):
        seam.check()


def test_an_operation_the_backend_cannot_order_is_a_counted_host_wait():
    seam, operation = StreamSeam(CPU, Clock()), Operation(can_order=False)
    operation.completed = True
    seam.settle(operation, 30.0, "a gloo reduction of CUDA tensors still on the host")
    assert operation.host_waits == [30.0] and seam.host_waits == 1
    seam.host_read()
    assert seam.host_waits == 2


def test_results_wanted_on_the_host_wait_within_what_is_left_of_each_deadline():
    clock = Clock()
    seam, operation = StreamSeam(CPU, clock), Operation()
    seam.settle(operation, 30.0, "the reduction of gradient bucket 0")
    clock.now += 12.0
    with pytest.raises(CommunicationTimeout):
        seam.wait_all(30.0)
    assert operation.host_waits == [18.0]


def test_held_objects_go_once_the_device_passed_their_mark():
    seam = StreamSeam(CPU, Clock())
    mark, held = Mark(), torch.zeros(4)
    alive = weakref.ref(held)
    seam.hold(mark, held)
    del held
    gc.collect()
    seam.check()
    assert alive() is not None, "let go before the device passed its mark"
    mark.passed = True
    seam.check()
    gc.collect()
    assert alive() is None, "still held after the device passed its mark"


def test_forget_lets_go_of_everything():
    clock = Clock()
    seam, operation = StreamSeam(CPU, clock), Operation()
    seam.settle(operation, 1.0, "never")
    held = torch.zeros(1)
    alive = weakref.ref(held)
    seam.hold(Mark(), held)
    del held
    seam.forget()
    gc.collect()
    clock.now += 10.0
    seam.check()
    assert alive() is None


def test_the_host_seam_waits_on_the_host_and_counts_nothing():
    seam, operation = HostSeam(), Operation()
    operation.completed = True
    seam.settle(operation, 5.0, "a reduction")
    assert operation.ordered == 0 and operation.host_waits == [5.0]
    seam.host_read()
    assert seam.host_waits == 0 and not seam.orders_streams and seam.mark() is None


def test_the_seam_follows_the_device_and_a_test_may_install_its_own():
    assert type(seam_for(CPU)) is HostSeam
    with using_seam(lambda device: StreamSeam(device, Clock())):
        assert type(seam_for(CPU)) is StreamSeam
    assert type(seam_for(CPU)) is HostSeam


class FailedWork:
    """A collective that failed before anyone waited (NCCL's watchdog aborted it, say)."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout=None) -> bool:
        raise RuntimeError("NCCL communicator was aborted on rank 1")


def test_a_collective_that_failed_already_is_a_communication_timeout_naming_it():
    with pytest.raises(CommunicationTimeout, match=r"the all-reduce of bucket 2 failed .*aborted on rank 1"):
        order_after_work(FailedWork(), on_nccl=True, what="the all-reduce of bucket 2")
