"""The all-reduce in two steps, as pure logic: its pieces, when the timing at the end of warm-up
takes it, and how it is configured."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import commsched
from commsched.comm.two_step import SecondSteps, piece_sizes
from commsched.planning.calibration import TwoStepTiming


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_pieces_cover_the_partition_and_differ_by_at_most_one_element(numel, world_size):
    sizes = piece_sizes(numel, world_size)
    assert len(sizes) == world_size and sum(sizes) == numel
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


def test_the_first_bucket_goes_in_two_steps_only_where_they_are_clearly_faster():
    assert TwoStepTiming(2**20, 5 * 2**20, ring_s=20e-3, two_step_s=12e-3).pays
    assert TwoStepTiming(2**20, 5 * 2**20, ring_s=20e-3, two_step_s=18e-3).pays  # 0.9 of the ring's time
    assert not TwoStepTiming(2**20, 5 * 2**20, ring_s=20e-3, two_step_s=18.5e-3).pays  # noise, not a gain
    assert not TwoStepTiming(2**20, 5 * 2**20, ring_s=20e-3, two_step_s=30e-3).pays
    assert TwoStepTiming(2**20, 5 * 2**20, 20e-3, 12e-3).describe() == (
        "at 1 MiB behind an all-reduce of 5 MiB, two all-to-alls took 12.0 ms and gloo's ring 20.0 ms")


def test_all_to_all_mb_is_auto_by_default_and_written_only_when_changed():
    assert commsched.AllReduce().all_to_all_mb == "auto"
    assert repr(commsched.AllReduce()) == "AllReduce()"
    assert repr(commsched.AllReduce(all_to_all_mb=None)) == "AllReduce(all_to_all_mb=None)"
    assert repr(commsched.AllReduce(shard_optimizer=True, all_to_all_mb=0.5)) == (
        "AllReduce(shard_optimizer=True, all_to_all_mb=0.5)")
    for value in (None, 0, 0.25, 4, "auto"):
        commsched.Strategy(backend=commsched.AllReduce(all_to_all_mb=value))


@pytest.mark.parametrize("value", ["fast", -1, float("nan"), float("inf"), True, [1]])
def test_a_bad_all_to_all_mb_is_refused_with_what_it_may_be(value):
    with pytest.raises(ValueError, match=r'AllReduce.all_to_all_mb must be "auto", None, or a size in MiB'):
        commsched.AllReduce(all_to_all_mb=value)


class _Reduction:
    """Records, for `SecondSteps`, when its second step is issued and when its callbacks go on."""

    def __init__(self, queue: SecondSteps, log: list, name: str):
        self.summed, self._queue, self._log, self._name = False, queue, log, name

    def issue_second_step(self, group: object) -> None:
        self._log.append((self._name, "issued", self._queue.locked))

    def second_step_issued(self) -> None:
        self._log.append((self._name, "callbacks", self._queue.locked))


def test_second_steps_go_in_first_step_order_and_their_callbacks_outside_the_lock():
    """A second step already complete runs its callbacks at once, on the thread that attaches them;
    they take the dispatcher's lock, which the training thread may hold while it waits to enqueue
    the next reduction: attached under the queue's lock, the two threads once waited on each other."""

    class Group:  # a process group stand-in: the queue only keeps a weak reference to it
        pass

    group = Group()
    queue, log = SecondSteps(group), []
    first, second, third = (_Reduction(queue, log, name) for name in ("first", "second", "third"))
    for reduction in (first, second, third):
        queue.enqueue(reduction)
    second.summed = True
    queue.first_step_done()
    assert log == []  # the first's first step is not done: nothing may overtake it
    first.summed = True
    queue.first_step_done()
    assert log == [("first", "issued", True), ("second", "issued", True),
                   ("first", "callbacks", False), ("second", "callbacks", False)]
    third.summed = True
    queue.first_step_done()
    assert log[4:] == [("third", "issued", True), ("third", "callbacks", False)]
