"""The all-reduce in two steps, as pure logic: its pieces, the size up to which the link's
measurement takes it, how the cost model prices it, and how it is configured."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import commsched
from commsched.comm.two_step import piece_sizes
from commsched.planning.calibration import two_step_max_bytes
from commsched.planning.schedule import LinkModel
from commsched.strategy import MIB


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_pieces_cover_the_partition_and_differ_by_at_most_one_element(numel, world_size):
    sizes = piece_sizes(numel, world_size)
    assert len(sizes) == world_size and sum(sizes) == numel
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


RING = LinkModel(latency_s=20e-3, bytes_per_s=100e6)
"""Among 8 hosts: 2(N-1) steps in a row cost a large fixed time."""


def test_two_steps_go_up_to_where_their_line_crosses_the_ring():
    two_step = LinkModel(latency_s=10e-3, bytes_per_s=50e6)  # half the fixed cost, half the bandwidth
    crossing = two_step_max_bytes(RING, two_step, largest_measured=64 * MIB)
    # 10 ms + n / 50 MB/s = 20 ms + n / 100 MB/s at n = 1 MB.
    assert crossing == pytest.approx(1e6, rel=1e-6)
    assert two_step.duration_s(crossing) == pytest.approx(RING.duration_s(crossing))


def test_two_steps_never_go_beyond_the_largest_size_measured():
    assert two_step_max_bytes(RING, LinkModel(10e-3, 50e6), largest_measured=2**19) == 2**19
    # Cheaper at every size: still only as far as measured.
    assert two_step_max_bytes(RING, LinkModel(10e-3, 200e6), largest_measured=8 * MIB) == 8 * MIB


def test_two_steps_are_not_taken_where_their_fixed_cost_is_no_lower():
    assert two_step_max_bytes(RING, LinkModel(20e-3, 1e9), largest_measured=8 * MIB) == 0
    assert two_step_max_bytes(RING, LinkModel(30e-3, 50e6), largest_measured=8 * MIB) == 0


def test_the_cost_model_prices_each_partition_by_the_way_it_goes():
    two_step = LinkModel(latency_s=10e-3, bytes_per_s=50e6)
    link = LinkModel(RING.latency_s, RING.bytes_per_s, two_step=two_step, two_step_max_bytes=10**6)
    assert link.duration_s(10**5) == pytest.approx(two_step.duration_s(10**5))
    assert link.duration_s(10**6) == pytest.approx(two_step.duration_s(10**6))
    assert link.duration_s(10**6 + 1) == pytest.approx(RING.duration_s(10**6 + 1))
    assert RING.duration_s(10**5) == pytest.approx(21e-3)  # without a two-step line, the ring throughout


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
