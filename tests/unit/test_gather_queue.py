"""The order and pace `GatherQueue` starts all-gathers in (see [Note: one all-gather at a time]).

Pure scheduling logic: the all-gathers are a recording fake whose completion the test
decides (a torch future); the real ones run in tests/distributed/test_sharded.py."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commsched.device import HostSeam
from commsched.errors import CommunicationTimeout
from commsched.update.gather_queue import GatherQueue, gathers_one_at_a_time

HOST = HostSeam()


class FakeGather:
    """A ``Work`` that finishes when the test says so."""

    def __init__(self) -> None:
        self.future: torch.futures.Future = torch.futures.Future()
        self._done = threading.Event()

    def get_future(self) -> torch.futures.Future:
        return self.future

    def wait(self, timeout) -> bool:
        if not self._done.wait(timeout.total_seconds()):
            raise RuntimeError("Operation timed out!")
        return True

    def finish(self) -> None:
        self._done.set()
        self.future.set_result(None)


class Recorder:
    """Starts fake all-gathers and records the order they started in."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.works: dict[str, FakeGather] = {}

    def begin(self, name: str):
        def start() -> FakeGather:
            self.started.append(name)
            self.works[name] = FakeGather()
            return self.works[name]
        return start


def test_host_memory_gathers_go_one_at_a_time_in_the_order_asked():
    queue, log = GatherQueue(), Recorder()
    gathers = {name: queue.submit(log.begin(name), f"gather {name}", True) for name in "abc"}
    assert log.started == ["a"]
    log.works["a"].finish()
    assert log.started == ["a", "b"]
    queue.wait(gathers["a"], 1.0, HOST)
    log.works["b"].finish()
    assert log.started == ["a", "b", "c"]
    log.works["c"].finish()
    for name in "bc":
        queue.wait(gathers[name], 1.0, HOST)


def test_gathers_not_held_back_all_start_when_asked():
    queue, log = GatherQueue(), Recorder()
    for name in "abc":
        queue.submit(log.begin(name), name, False)
    assert log.started == ["a", "b", "c"]


def test_another_collective_on_the_group_starts_everything_queued_first():
    queue, log = GatherQueue(), Recorder()
    for name in "abc":
        queue.submit(log.begin(name), name, True)
    queue.start_all()
    assert log.started == ["a", "b", "c"]
    log.works["a"].finish()
    assert log.started == ["a", "b", "c"], "a gather started twice"


def test_waiting_for_a_queued_gather_waits_for_the_ones_before_it():
    queue, log = GatherQueue(), Recorder()
    first = queue.submit(log.begin("a"), "a", True)
    second = queue.submit(log.begin("b"), "b", True)

    def finish_in_turn() -> None:
        log.works["a"].finish()
        log.works["b"].finish()

    threading.Timer(0.05, finish_in_turn).start()  # a communication thread, finishing them later
    queue.wait(second, 10.0, HOST)
    assert log.started == ["a", "b"]
    queue.wait(first, 1.0, HOST)


def test_a_gather_stuck_behind_one_that_never_finishes_times_out_with_its_name():
    queue, log = GatherQueue(), Recorder()
    queue.submit(log.begin("a"), "gather a", True)
    stuck = queue.submit(log.begin("b"), "the all-gather of bucket 3", True)
    with pytest.raises(CommunicationTimeout, match="the all-gather of bucket 3, which waited for the all-gathers"):
        queue.wait(stuck, 0.05, HOST)


def test_a_gather_that_fails_to_start_raises_at_its_wait():
    queue = GatherQueue()

    def broken():
        raise RuntimeError("connection reset by peer")

    gather = queue.submit(broken, "the all-gather of bucket 1", True)
    with pytest.raises(CommunicationTimeout, match="the all-gather of bucket 1.*connection reset"):
        queue.wait(gather, 1.0, HOST)


def test_only_tensors_in_host_memory_are_held_back():
    assert gathers_one_at_a_time(torch.device("cpu"))
    assert not gathers_one_at_a_time(torch.device("cuda", 0))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["submit", "finish", "start_all"]), st.integers(0, 7)), max_size=40))
def test_any_interleaving_starts_them_in_order_and_one_at_a_time(ops):
    queue, log = GatherQueue(), Recorder()
    asked: list[str] = []
    flushed = False
    for op, pick in ops:
        if op == "submit":
            name = f"g{len(asked)}"
            asked.append(name)
            queue.submit(log.begin(name), name, True)
        elif op == "finish":
            running = [n for n in log.started if not log.works[n].future.done()]
            if running:
                log.works[running[pick % len(running)]].finish()
        else:
            queue.start_all()
            flushed = True
        assert log.started == asked[:len(log.started)], "started out of order"
        running = [n for n in log.started if not log.works[n].future.done()]
        if not flushed:
            assert len(running) <= 1, f"two at once: {running}"
        if not running:
            assert log.started == asked, "nothing runs, yet some wait"


def test_a_gather_not_held_back_holds_back_nothing():
    """One group, CUDA tensors on NCCL beside tensors in host memory on gloo: an NCCL all-gather
    in flight does not keep a gloo one from starting."""
    queue, log = GatherQueue(), Recorder()
    queue.submit(log.begin("cuda"), "cuda", False)
    queue.submit(log.begin("host"), "host", True)
    assert log.started == ["cuda", "host"]
