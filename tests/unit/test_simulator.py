"""The simulator against cases with a known answer, and properties every answer must have. Pure logic."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commsched.layout.buckets import bucket_layout
from commsched.layout.partitions import make_partitions
from commsched.planning.schedule import LinkModel, simulate_schedule
from commsched.planning.wire import Flight, Wire, wire_share
from commsched.profiling.profile import LinkProfile, LinkSample, Profile
from commsched.simulator import (
    Cluster,
    DDPConfig,
    SimResult,
    best_strategy,
    bound_s,
    sharded_bound_s,
    simulate,
    strategy_space,
)
from commsched.simulator.engine import first_bucket_pays
from commsched.strategy import MIB, AllReduce, ParameterServer, Strategy
from commsched.testing.profiles import balanced_profile, make_profile

LITERAL = Strategy(adaptive=False)
"""commsched's defaults, taken literally."""


def compute_s(profile: Profile) -> float:
    return profile.forward_s + profile.backward_s + profile.update_s


def profile_bytes(profile: Profile) -> int:
    return sum(p.numel * p.element_size for p in profile.parameters)


def unnamed(result: SimResult) -> SimResult:
    return dataclasses.replace(result, system="")


# ------------------------------------------------------------------ collectives
def test_ring_formula():
    cluster = Cluster(workers=4, gbit_s=8.0, latency_s=1e-5, host_overhead_s=1e-4)  # 1e9 bytes/s
    assert cluster.allreduce_s(10**6) == pytest.approx(6 * 1e-5 + 1.5 * 1e6 / 1e9 + 1e-4)
    assert cluster.allreduce_s(0) == pytest.approx(6e-5 + 1e-4)
    assert Cluster(workers=1024, gbit_s=8.0, latency_s=1e-5).allreduce_s(2**20) == pytest.approx(
        2 * 1023 * 1e-5 + 2 * 1023 / 1024 * 2**20 / 1e9)


def test_tree_and_push_pull_formulas():
    tree = Cluster(workers=1000, gbit_s=8.0, latency_s=1e-5, algorithm="tree", host_overhead_s=1e-4)
    assert tree.allreduce_s(10**6) == pytest.approx(2 * 10 * 1e-5 + 2 * 1e6 / 1e9 + 1e-4)
    ps = Cluster(workers=8, gbit_s=8.0, latency_s=1e-5, servers=2, host_overhead_s=1e-4)
    assert ps.push_pull_s(10**6) == pytest.approx(8 * 1e6 / 1e9 + 2e-5 + 1e-4)


def test_tree_beats_ring_for_small_messages_at_1024_workers():
    ring, tree = Cluster(1024, 100.0), Cluster(1024, 100.0, algorithm="tree")
    for nbytes in (4, 2**16, 2**20):
        assert tree.allreduce_s(nbytes) < ring.allreduce_s(nbytes) / 10
    # Its bandwidth term is twice the ring's: with few workers and large messages the ring wins.
    assert Cluster(2, 100.0).allreduce_s(2**30) < Cluster(2, 100.0, algorithm="tree").allreduce_s(2**30)


def test_cluster_refuses_bad_values_with_the_field():
    for kwargs, field in (({"workers": 0}, "workers"), ({"gbit_s": 0}, "gbit_s"), ({"latency_s": -1}, "latency_s"),
                          ({"algorithm": "mesh"}, "algorithm"), ({"servers": -1}, "servers"),
                          ({"compute_slowdown": math.nan}, "compute_slowdown"), ({"in_flight": 0}, "in_flight"),
                          ({"in_flight": 1.5}, "in_flight"), ({"in_flight": True}, "in_flight"),
                          ({"all_to_all": 1}, "all_to_all")):
        with pytest.raises(ValueError, match=field):
            Cluster(**{"workers": 2, "gbit_s": 1.0, **kwargs})
    with pytest.raises(ValueError, match="servers=1"):
        Cluster(2, 1.0).push_pull_s(10)


def test_from_link_inverts_a_measured_ring():
    """A cluster's link as a two-replica measurement would record it gives that cluster back."""
    for world in (2, 4):
        cluster = Cluster(world, 10.0, latency_s=25e-6, host_overhead_s=2e-4, compute_slowdown=0.15,
                          collective_slowdown=0.4, in_flight=2)
        link = cluster.link_profile()
        assert link.world_size == world and link.samples, link
        for sample in link.samples:
            assert link.duration_s(sample.nbytes) == pytest.approx(sample.seconds)
        back = Cluster.from_link(link, workers=world)
        assert back.gbit_s == pytest.approx(10.0)
        assert back.latency_s == pytest.approx(25e-6)
        assert back.host_overhead_s == pytest.approx(2e-4)
        assert (back.compute_slowdown, back.collective_slowdown, back.in_flight) == (0.15, 0.4, 2)
        scaled = Cluster.from_link(link, workers=256, gbit_s=40.0)
        assert (scaled.workers, scaled.gbit_s, scaled.latency_s) == (256, 40.0, back.latency_s)
        assert scaled.allreduce_s(0) == pytest.approx(2 * 255 * 25e-6 + 2e-4)


def test_from_link_by_hand():
    """2 replicas: 1 ms fixed, 1e9 bytes/s of all-reduce throughput, which a ring gets from 1e9 bytes/s links
    (2 (N-1)/N = 1); 1 ms = 2 hops of 25 us + 950 us of host work."""
    link = LinkProfile(2, (LinkSample(2**20, 1e-3 + 2**20 / 1e9),), latency_s=1e-3, bytes_per_s=1e9)
    cluster = Cluster.from_link(link, workers=2)
    assert cluster.gbit_s == pytest.approx(8.0)
    assert cluster.latency_s == pytest.approx(25e-6)
    assert cluster.host_overhead_s == pytest.approx(950e-6)
    fast = Cluster.from_link(dataclasses.replace(link, latency_s=10e-6), workers=2)
    assert (fast.latency_s, fast.host_overhead_s) == (pytest.approx(5e-6), 0.0)
    with pytest.raises(ValueError, match="at least 2 replicas"):
        Cluster.from_link(dataclasses.replace(link, world_size=1), workers=8)


# ------------------------------------------------------------------ analytic cases
def test_one_parameter_ddp_is_compute_plus_one_allreduce():
    profile = make_profile([8.0], forward_s=0.05, backward_s=0.1, update_s=0.01)
    cluster = Cluster(8, 1.0, latency_s=1e-4, host_overhead_s=1e-3)
    result = simulate(profile, cluster, DDPConfig())
    allreduce = cluster.allreduce_s(8 * MIB)
    assert result.iteration_s == pytest.approx(compute_s(profile) + allreduce)
    assert result.compute_s == pytest.approx(compute_s(profile))
    assert result.exposed_s == pytest.approx(allreduce)
    assert result.link_busy_s == pytest.approx(allreduce)
    assert result.collectives == 1
    assert "1 collectives" in result.describe()


def test_communication_beside_computation_stretches_it():
    """DDP, two parameters: the output layer's 1 MiB bucket is reduced at the start of backward, beside it;
    the input layer's after it, with nothing beside. While the first is on the wire (``first`` seconds) the
    backward pass gets only ``first / 1.5`` done: it ends ``first / 3`` later."""
    profile = make_profile([4.0, 1.0], forward_s=0.05, backward_s=0.2, update_s=0.01)
    profile = dataclasses.replace(profile, parameters=(
        profile.parameters[0], dataclasses.replace(profile.parameters[1], ready_s=0.0)))
    cluster = Cluster(4, 1.0, compute_slowdown=0.5)
    first, last = cluster.allreduce_s(MIB), cluster.allreduce_s(4 * MIB)
    assert first < profile.backward_s
    result = simulate(profile, cluster, DDPConfig())
    assert result.iteration_s == pytest.approx(compute_s(profile) + first / 3 + last)
    assert result.contention_s == pytest.approx(first / 3)
    calm = simulate(profile, dataclasses.replace(cluster, compute_slowdown=0.0), DDPConfig())
    assert calm.iteration_s == pytest.approx(compute_s(profile) + last)


def test_computation_beside_a_collective_stretches_the_collective():
    """The same two buckets: the output layer's goes out while backward computes, so with
    ``collective_slowdown`` 1 it takes twice as long on the wire (still hidden: the backward pass is
    longer); the input layer's goes out when the worker waits for it, at full speed. The rate follows
    the worker: slow while it computes, full while it waits."""
    profile = make_profile([4.0, 1.0], forward_s=0.05, backward_s=0.2, update_s=0.01)
    profile = dataclasses.replace(profile, parameters=(
        profile.parameters[0], dataclasses.replace(profile.parameters[1], ready_s=0.0)))
    cluster = Cluster(4, 1.0, collective_slowdown=1.0)
    first, last = cluster.allreduce_s(MIB), cluster.allreduce_s(4 * MIB)
    assert 2 * first < profile.backward_s
    ddp = simulate(profile, cluster, DDPConfig())
    assert ddp.iteration_s == pytest.approx(compute_s(profile) + last)
    assert ddp.link_busy_s == pytest.approx(2 * first + last)
    whole = Strategy(partition_mb=None, credit_mb=None, bucket_cap_mb=1.0, first_bucket_mb=1.0, adaptive=False)
    waits = simulate(profile, cluster, dataclasses.replace(whole, overlap_forward=False))
    overlaps = simulate(profile, cluster, whole)
    calm = dataclasses.replace(cluster, collective_slowdown=0.0)
    # Without overlap the worker updates the output layer's bucket while the input layer's is on the
    # wire: computing, so that part of it runs slower (by at most the update's time).
    assert 2 * first + last < waits.link_busy_s <= 2 * first + last + profile.update_s
    # With overlap the next forward pass reads the input layer first, so the worker waits for it at
    # once, at full speed: no slower than without the slowdown.
    assert overlaps.iteration_s == pytest.approx(simulate(profile, calm, whole).iteration_s)
    # Had it other layers to compute first, the input layer's bucket would be slowed meanwhile.
    late = dataclasses.replace(profile, parameters=(
        dataclasses.replace(profile.parameters[0], first_use_s=0.04), profile.parameters[1]))
    assert simulate(late, cluster, whole).iteration_s > simulate(late, calm, whole).iteration_s


def test_the_bucket_the_forward_pass_reads_first_goes_when_the_backward_pass_ends():
    """It carries commsched's usage flags, so it is held until the backward pass ends (here 0.1 s after its
    gradient), then reduced while the next forward pass waits for it at its first layer. torch DDP reduces
    it as soon as its gradient is ready."""
    profile = make_profile([1.0, 1.0], forward_s=0.05, backward_s=0.1, update_s=0.0)
    cluster = Cluster(4, 10.0)
    reduce_first_layer = cluster.allreduce_s(MIB)
    for backward_s in (0.2, 0.05):  # the backward pass ends at backward_s or at its last gradient (0.1 s)
        timed = dataclasses.replace(profile, backward_s=backward_s)
        end = max(backward_s, 0.1)
        assert simulate(timed, cluster, LITERAL).iteration_s == pytest.approx(
            profile.forward_s + end + reduce_first_layer)
        assert simulate(timed, cluster, DDPConfig()).iteration_s == pytest.approx(
            profile.forward_s + max(end, 0.1 + reduce_first_layer))


def test_infinite_bandwidth_leaves_compute_and_overheads():
    profile = balanced_profile()
    free = Cluster(64, math.inf, latency_s=0.0)
    ps_free = dataclasses.replace(free, servers=4)
    ps = Strategy(backend=ParameterServer(num_servers=4, block_mb=None), adaptive=False)
    for system in (DDPConfig(), LITERAL, dataclasses.replace(LITERAL, priority=False),
                   dataclasses.replace(LITERAL, overlap_forward=False)):
        result = simulate(profile, free, system)
        assert result.iteration_s == pytest.approx(compute_s(profile))
        assert result.exposed_s == pytest.approx(0.0, abs=1e-12)
    # The servers update: the worker computes forward and backward, and waits for the update of the
    # bucket the forward pass reads first (it is sent when the backward pass ends).
    result = simulate(profile, ps_free, ps)
    without_update = profile.forward_s + profile.backward_s
    assert result.compute_s == pytest.approx(without_update)
    first_layer = profile.parameters[0].nbytes  # alone in its bucket, one block
    assert result.exposed_s == pytest.approx(profile.update_s * first_layer / profile.gradient_bytes)
    # With per-collective costs, at most the collectives' own time on top.
    costly = Cluster(64, math.inf, latency_s=1e-6, host_overhead_s=1e-4)
    for system in (DDPConfig(), LITERAL):
        result = simulate(profile, costly, system)
        assert compute_s(profile) < result.iteration_s <= compute_s(profile) + result.link_busy_s


def test_a_very_slow_link_makes_the_iteration_the_link_time():
    profile = balanced_profile()
    slow = Cluster(16, 0.005)  # about 25 s for every gradient, against 0.16 s of compute
    for system in (DDPConfig(), LITERAL, dataclasses.replace(LITERAL, overlap_forward=False),
                   dataclasses.replace(LITERAL, partition_mb=None, credit_mb=None)):
        result = simulate(profile, slow, system)
        assert result.link_busy_s <= result.iteration_s <= 1.02 * result.link_busy_s
        assert result.iteration_s <= 1.02 * bound_s(profile, slow)


def test_commsched_with_overlap_beats_ddp_when_communication_is_as_long_as_compute():
    profile = balanced_profile()
    cluster = Cluster(8, 4.0, latency_s=10e-6)
    assert 0.5 < cluster.allreduce_s(profile.gradient_bytes) / compute_s(profile) < 2
    ddp = simulate(profile, cluster, DDPConfig())
    ours = simulate(profile, cluster, LITERAL)
    assert ours.iteration_s < 0.9 * ddp.iteration_s, (ours.describe(), ddp.describe())
    assert bound_s(profile, cluster) <= ours.iteration_s


def test_more_servers_are_faster_until_compute_bound():
    """100 MiB through 8 workers' copies: one server's link needs 0.67 s, against 0.3 s of compute; from about
    three servers on the iteration is the computation and the last bucket's push and pull."""
    profile = make_profile([4.0] * 25, forward_s=0.1, backward_s=0.2, update_s=0.02)
    times = []
    for servers in (1, 2, 3, 4, 8, 16):
        cluster = Cluster(8, 10.0, servers=servers)
        result = simulate(profile, cluster, Strategy(backend=ParameterServer(num_servers=servers), adaptive=False))
        assert result.iteration_s >= bound_s(profile, cluster) * (1 - 1e-9)
        times.append(result.iteration_s)
    compute = profile.forward_s + profile.backward_s  # the servers update
    assert times[0] > 1.8 * times[1] and times[1] > times[2] > times[3] >= times[4] >= times[5]
    assert times[0] > 2 * compute and times[3] < 1.05 * compute


def test_a_parameter_server_strategy_needs_the_same_servers_in_the_cluster():
    with pytest.raises(ValueError, match="servers=2"):
        simulate(balanced_profile(), Cluster(8, 10.0, servers=1), Strategy(backend=ParameterServer(num_servers=2)))


# ------------------------------------------------------------------ one code path, mirrored rules
def test_fifo_whole_buckets_without_overlap_is_ddp():
    """The same code path: commsched with scheduling off takes exactly DDP's time when updates cost
    nothing; with updates it is never slower (a finished bucket is updated while later ones reduce)."""
    cluster = Cluster(8, 2.0, compute_slowdown=0.2)
    for caps in ((25.0, 1.0), (5.0, 5.0), (100.0, 4.0)):
        off = Strategy(priority=False, partition_mb=None, credit_mb=None, overlap_forward=False, adaptive=False,
                       bucket_cap_mb=caps[0], first_bucket_mb=caps[1])
        ddp = DDPConfig(*caps)
        free = balanced_profile(update_s=0.0)
        assert unnamed(simulate(free, cluster, off)) == unnamed(simulate(free, cluster, ddp))
        with_updates = balanced_profile(update_s=0.03)
        ours, theirs = simulate(with_updates, cluster, off), simulate(with_updates, cluster, ddp)
        assert ours.collectives == theirs.collectives
        assert ours.iteration_s < theirs.iteration_s <= ours.iteration_s + with_updates.update_s


@pytest.mark.parametrize("in_flight", [1, 2])
@pytest.mark.parametrize("priority, credit_mb", [(True, 2.0), (True, None), (False, 2.0), (True, 0.5)])
def test_issue_rules_mirror_simulate_schedule(priority, credit_mb, in_flight):
    """One backward pass without contention: every bucket reduced when `simulate_schedule` says. Read off
    the next forward pass's stalls (each bucket's first use waits for its last partition), rebuilt here."""
    # the backward pass ends after its last gradient: the flags bucket is held until then
    profile = dataclasses.replace(balanced_profile(update_s=0.0), backward_s=0.12)
    cluster = Cluster(4, 3.0, latency_s=1e-4, host_overhead_s=2e-3, in_flight=in_flight)
    strategy = Strategy(priority=priority, credit_mb=credit_mb, partition_mb=1.0, adaptive=False)
    result = simulate(profile, cluster, strategy, iterations=2)

    tensors = [torch.empty(p.numel, device="meta") for p in profile.parameters]
    order = profile.forward_order
    slots, priorities = bucket_layout(tensors, order, strategy.bucket_size_limits_bytes)
    numels = [sum(profile.parameters[s].numel for s in bucket) for bucket in slots]
    parts = make_partitions(numels, [4] * len(slots), priorities, strategy.partition_bytes)
    flags = next(b for b, bucket in enumerate(slots) if order[0] in bucket)
    ready = [profile.backward_s if b == flags else max(profile.parameters[s].ready_s for s in bucket)
             for b, bucket in enumerate(slots)]
    link = LinkModel(cluster.allreduce_s(0), cluster.bytes_per_s * 4 / (2 * 3), in_flight)
    schedule = simulate_schedule(parts, ready, link, strategy.credit_bytes, priority)
    done = [max(schedule.finish_s[p.pid] for p in parts if p.bucket == b) for b in range(len(slots))]
    gates = sorted(range(len(slots)), key=lambda b: (min(profile.parameters[s].first_use_s for s in slots[b]), b))
    now, at = profile.backward_s, 0.0  # the second forward pass starts, from the first backward pass's start
    for b in gates:
        gate = min(profile.parameters[s].first_use_s for s in slots[b])
        now = max(now + gate - at, done[b])
        at = gate
    # the second iteration runs from its start to the end of its own backward pass
    start, end = profile.backward_s, now + profile.forward_s - at + profile.backward_s
    assert result.iteration_s == pytest.approx(end - start, rel=1e-9)
    assert result.exposed_s > 0.01  # the case is one where the gates matter


# ------------------------------------------------------------------ two collectives at once
def at_the_end_of_backward(sizes_mb, forward_s=0.05, backward_s=0.1, update_s=0.0) -> Profile:
    """Every gradient ready at once, when the backward pass ends: torch DDP with buckets of one
    parameter each issues them all together, and the worker waits for the last."""
    profile = make_profile(sizes_mb, forward_s, backward_s, update_s)
    return dataclasses.replace(profile, parameters=tuple(
        dataclasses.replace(p, ready_s=backward_s) for p in profile.parameters))


def exposed_s(sizes_mb, cluster: Cluster) -> float:
    smallest = min(sizes_mb)
    result = simulate(at_the_end_of_backward(sizes_mb), cluster, DDPConfig(smallest, smallest))
    assert result.collectives == len(sizes_mb)
    return result.exposed_s


GAPS = Cluster(8, 1.0, latency_s=1e-3, host_overhead_s=5e-3, in_flight=2)
"""19 ms of fixed cost per all-reduce, 14.7 ms per MiB on the wire; two at once."""


def test_two_collectives_at_once_take_turns():
    """[Note: two collectives at once]: a round of both lasts the longer one alone or both chunks on the
    wire; each runs at its own time alone over the round's."""
    one, fixed = GAPS.allreduce_s(4 * MIB), GAPS.allreduce_s(0)
    assert one < 2 * (one - fixed)  # two of 4 MiB: the wire sets the pace
    assert exposed_s([4.0], GAPS) == pytest.approx(one)
    assert exposed_s([4.0, 4.0], GAPS) == pytest.approx(2 * (one - fixed))
    # One place: one at a time, as before.
    single = dataclasses.replace(GAPS, in_flight=1)
    assert exposed_s([4.0, 4.0], single) == pytest.approx(2 * one)
    # A third waits for a place, then runs alone.
    assert exposed_s([4.0, 4.0, 4.0], GAPS) == pytest.approx(2 * (one - fixed) + one)
    # Two whose chunks fit in each other's latency run side by side at full rate.
    assert 2 * (GAPS.allreduce_s(MIB) - fixed) < GAPS.allreduce_s(MIB)
    assert exposed_s([1.0, 1.0], GAPS) == pytest.approx(GAPS.allreduce_s(MIB))


def test_a_small_collective_behind_a_large_one_finishes_with_it():
    large, small = GAPS.allreduce_s(8 * MIB), GAPS.allreduce_s(MIB)
    fixed = GAPS.allreduce_s(0)
    assert (large - fixed) + (small - fixed) < large  # the large one's steps set the pace of both
    assert exposed_s([1.0, 8.0], GAPS) == pytest.approx(large)  # the output layer's goes first
    assert exposed_s([1.0, 8.0], dataclasses.replace(GAPS, in_flight=1)) == pytest.approx(large + small)
    for sizes in ([8.0, 0.125], [1.0] * 5, [0.25, 4.0, 1.0, 2.0], [16.0, 16.0]):
        assert exposed_s(sizes, GAPS) <= exposed_s(sizes, dataclasses.replace(GAPS, in_flight=1)) + 1e-12
    # Collectives that are all wire share it: two of them take as long as one after the other.
    no_gaps = Cluster(8, 1.0, latency_s=0.0, in_flight=2)
    assert exposed_s([4.0, 4.0], no_gaps) == pytest.approx(2 * no_gaps.allreduce_s(4 * MIB))


def test_other_connections_share_the_wire_without_taking_turns():
    """[Note: two collectives at once]: a collective on a lane of its own (two all-to-alls) shares the
    wire's bandwidth with the ring's but does not wait for its steps."""
    large, small = 10.0, 0.6  # seconds alone; 0.5 of each is fixed cost
    for lane, small_done in ((0, large), (1, small * (9.5 / 10.0 + 0.1 / 0.6))):  # the busy shares add up
        wire = Wire(2)
        wire.add(Flight((0, 0), large, wire_share(large, 0.5)))
        wire.add(Flight((0, 1), small, wire_share(small, 0.5), lane=lane))
        assert wire.finish_times()[(0, 1)] == pytest.approx(small_done)
    # All wire, nothing to take turns in: two lanes split it as one lane does.
    for lane in (0, 1):
        wire = Wire(2)
        wire.add(Flight((0, 0), 1.0, 1.0))
        wire.add(Flight((0, 1), 1.0, 1.0, lane=lane))
        assert wire.finish_times() == pytest.approx({(0, 0): 2.0, (0, 1): 2.0})


def test_two_step_formula_and_the_first_bucket_that_pays():
    """[Note: an all-reduce in two steps]: two hops and two collectives' host cost, a ring's bytes; the
    first bucket goes so, as warm-up decides, where right behind the largest other bucket it is done
    within `TWO_STEP_SHARE` of the ring's time."""
    cluster = Cluster(8, 0.5, latency_s=25e-6, host_overhead_s=5e-3, in_flight=2, all_to_all=True)
    assert cluster.two_step_s(MIB) == pytest.approx(2 * 25e-6 + 1.75 * MIB / 62.5e6 + 2 * 5e-3)
    assert first_bucket_pays(cluster, MIB, int(5.5 * MIB))  # the ring would take turns with 5.5 MiB
    assert not first_bucket_pays(cluster, MIB, 4)  # alone, two steps cost one more host overhead
    profile = make_profile([1.0] + [5.5] * 4, forward_s=0.1, backward_s=0.2, update_s=0.0)
    ring = dataclasses.replace(cluster, all_to_all=False)
    default, two_steps = simulate(profile, ring, LITERAL), simulate(profile, cluster, LITERAL)
    assert two_steps.iteration_s < default.iteration_s
    never = Strategy(backend=AllReduce(all_to_all_mb=None), adaptive=False)
    assert unnamed(simulate(profile, cluster, never)) == unnamed(default)
    # Two workers: a ring takes two steps anyway, and the transport never takes these.
    pair = dataclasses.replace(cluster, workers=2)
    assert unnamed(simulate(profile, pair, LITERAL)) == unnamed(simulate(
        profile, dataclasses.replace(pair, all_to_all=False), LITERAL))


def test_the_link_of_two_at_once_counts_once_in_its_busy_time():
    result = simulate(at_the_end_of_backward([1.0, 1.0]), GAPS, DDPConfig(1.0, 1.0))
    assert result.link_busy_s == pytest.approx(GAPS.allreduce_s(MIB))


def test_parameter_servers_links_run_one_at_a_time():
    profile = make_profile([4.0] * 8, forward_s=0.01, backward_s=0.02, update_s=0.0)
    strategy = Strategy(backend=ParameterServer(num_servers=2), partition_mb=1.0, adaptive=False)
    cluster = Cluster(4, 1.0, servers=2, host_overhead_s=5e-3)
    assert simulate(profile, dataclasses.replace(cluster, in_flight=2), strategy) == simulate(
        profile, cluster, strategy)


# ------------------------------------------------------------------ properties
def test_simulation_is_deterministic():
    profile, cluster = balanced_profile(), Cluster(32, 5.0, compute_slowdown=0.3)
    for system in (DDPConfig(), LITERAL, strategy_space()[17]):
        assert simulate(profile, cluster, system) == simulate(profile, cluster, system)


_SPACE = strategy_space()


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.floats(0.01, 16.0), min_size=1, max_size=12),
    times=st.tuples(st.floats(0.0, 0.2), st.floats(0.001, 0.3), st.floats(0.0, 0.05)),
    workers=st.integers(2, 512),
    gbit_s=st.floats(0.05, 400.0),
    algorithm=st.sampled_from(["ring", "tree"]),
    slowdown=st.floats(0.0, 1.0),
    system=st.one_of(st.sampled_from(_SPACE), st.builds(DDPConfig, st.sampled_from([1.0, 5.0, 25.0]),
                                                          st.sampled_from([1.0, 4.0]))),
    in_flight=st.sampled_from([1, 2, 3]),
)
def test_no_system_beats_the_bound(sizes, times, workers, gbit_s, algorithm, slowdown, system, in_flight):
    profile = make_profile(sizes, *times)
    cluster = Cluster(workers, gbit_s, algorithm=algorithm, compute_slowdown=slowdown, in_flight=in_flight)
    result = simulate(profile, cluster, system)
    # However many are in flight, the link carries every gradient's bytes once per iteration.
    wire_s = cluster.allreduce_s(profile_bytes(profile)) - cluster.allreduce_s(0)
    assert result.iteration_s >= max(compute_s(profile), wire_s) * (1 - 1e-9)
    if in_flight == 1:
        assert result.iteration_s >= bound_s(profile, cluster) * (1 - 1e-9)
    assert result.iteration_s == pytest.approx(result.compute_s + result.exposed_s)
    assert result.compute_s >= compute_s(profile) * (1 - 1e-9)


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.floats(0.01, 16.0), min_size=1, max_size=12), servers=st.integers(1, 8),
       workers=st.integers(1, 64), gbit_s=st.floats(0.05, 100.0), partition=st.sampled_from([0.25, 1.0, None]))
def test_no_parameter_server_system_beats_its_bound(sizes, servers, workers, gbit_s, partition):
    profile = make_profile(sizes)
    cluster = Cluster(workers, gbit_s, servers=servers)
    strategy = Strategy(backend=ParameterServer(num_servers=servers), partition_mb=partition, adaptive=False)
    assert simulate(profile, cluster, strategy).iteration_s >= bound_s(profile, cluster) * (1 - 1e-9)


def test_sharded_state_is_bound_by_the_gather_after_the_backward_pass():
    """[Note: the bound of sharded state] The new values exist only after backward: where their
    all-gather outlasts the forward pass, the bound is the backward pass, the gather, and the
    forward pass after the last parameter's first use; ZeRO-1's link also carries an all-reduce."""
    profile = make_profile([4.0] * 25, forward_s=0.04, backward_s=0.1, update_s=0.0)  # 100 MiB
    slow = Cluster(8, 8.0, latency_s=0.0)  # 1e9 bytes/s: the gather takes 7/8 * 100 MiB / 1e9 = 91.8 ms
    gather_s = 7 / 8 * 100 * MIB / 1e9
    last_use_s = 0.04 * 24 / 25
    assert sharded_bound_s(profile, slow, reduce_scatter=True) == pytest.approx(0.1 + gather_s + 0.04 - last_use_s)
    assert sharded_bound_s(profile, slow, reduce_scatter=True) > bound_s(profile, slow)
    assert sharded_bound_s(profile, slow, reduce_scatter=False) == pytest.approx(3 * gather_s)
    # A link ten times faster: the gather hides in the forward pass, and sharding adds nothing.
    fast = Cluster(8, 80.0, latency_s=0.0)
    for reduce_scatter in (False, True):
        assert sharded_bound_s(profile, fast, reduce_scatter) == pytest.approx(bound_s(profile, fast))
        assert sharded_bound_s(profile, Cluster(1, 8.0), reduce_scatter) == bound_s(profile, Cluster(1, 8.0))


def test_bound_with_servers_is_the_busiest_server_link():
    profile = make_profile([4.0] * 25, forward_s=0.01, backward_s=0.01, update_s=0.0)
    cluster = Cluster(8, 8.0, servers=4)  # 1e9 bytes/s
    assert bound_s(profile, cluster) == pytest.approx(8 * 100 * MIB / 4 / 1e9)
    assert bound_s(profile, Cluster(8, 8.0)) == pytest.approx(Cluster(8, 8.0).allreduce_s(100 * MIB))
    fast = Cluster(8, 1000.0)
    assert bound_s(profile, fast) == pytest.approx(compute_s(profile))
    assert bound_s(dataclasses.replace(profile, update_s=0.1), fast) == pytest.approx(0.12)


# ------------------------------------------------------------------ the search
def test_strategy_space_is_literal_deduplicated_and_covers_the_grid():
    space = strategy_space()
    assert all(not s.adaptive and s.priority for s in space)
    assert len(set(space)) == len(space)
    keys = {(tuple(s.bucket_size_limits_bytes), s.partition_bytes, s.credit_bytes, s.overlap_forward) for s in space}
    assert len(keys) == len(space)
    assert {s.partition_mb for s in space} == {0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, None}
    assert {(s.partition_mb, s.credit_mb) for s in space} >= {(0.25, 2.0), (16.0, 128.0), (2.0, None), (None, None)}
    assert {s.bucket_cap_mb for s in space if s.partition_mb is None} == {5.0, 25.0, 100.0}
    # whole buckets: each cap with each first bucket, with and without overlap
    assert len([s for s in space if s.partition_mb is None]) == 3 * 2 * 2
    base = Strategy(backend=ParameterServer(num_servers=3), broadcast_buffers=False)
    assert all(s.backend == base.backend and not s.broadcast_buffers for s in strategy_space(base))


def test_best_strategy_is_the_fastest_of_the_space():
    profile, cluster = balanced_profile(), Cluster(64, 10.0, compute_slowdown=0.1)
    space = strategy_space()[::9]
    chosen, result = best_strategy(profile, cluster, space)
    assert chosen in space
    times = [simulate(profile, cluster, s).iteration_s for s in space]
    assert result.iteration_s <= min(times) + 1e-6
    ties = [s for s, t in zip(space, times, strict=True) if t <= min(times) + 1e-6]
    assert result.collectives == min(simulate(profile, cluster, s).collectives for s in ties)
    assert result == simulate(profile, cluster, chosen)
    assert max(times) > min(times)
    # Less than a microsecond apart is a tie, and fewer collectives win it.
    whole = Strategy(partition_mb=None, credit_mb=None, bucket_cap_mb=100.0, overlap_forward=False, adaptive=False)
    smaller = dataclasses.replace(whole, bucket_cap_mb=5.0)
    instant = Cluster(2, 8e5, latency_s=0.0)
    no_update = balanced_profile(update_s=0.0)  # the last bucket's reduction is all that shows
    few, many = simulate(no_update, instant, whole), simulate(no_update, instant, smaller)
    assert many.iteration_s < few.iteration_s < many.iteration_s + 1e-6 and few.collectives < many.collectives
    assert best_strategy(no_update, instant, [smaller, whole])[0] == whole
    assert best_strategy(no_update, instant, [smaller, whole, smaller])[0] == whole
    default_chosen, _ = best_strategy(profile, cluster)
    assert default_chosen in strategy_space()
    with pytest.raises(ValueError, match="empty"):
        best_strategy(profile, cluster, [])


def test_best_strategy_considers_parameter_servers_on_a_cluster_with_servers():
    profile = make_profile([4.0] * 25, forward_s=0.1, backward_s=0.2, update_s=0.02)
    chosen, _ = best_strategy(profile, Cluster(8, 10.0, servers=8))
    assert chosen.parameter_server and chosen.backend.num_servers == 8
    # The partition sizes searched are the block sizes: no block_mb cuts them.
    assert chosen.backend.block_mb is None
    assert chosen.ps_block_bytes == (chosen.partition_bytes or chosen.bucket_size_limits_bytes[1])


def test_simulate_refuses_what_it_cannot_simulate():
    with pytest.raises(ValueError, match="iterations"):
        simulate(balanced_profile(), Cluster(2, 1.0), LITERAL, iterations=0)
    with pytest.raises(TypeError, match="DDPConfig"):
        simulate(balanced_profile(), Cluster(2, 1.0), "ddp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DDPConfig(bucket_cap_mb=0)
    assert DDPConfig.like_torch() == DDPConfig(25.0, 1.0) and DDPConfig.like_torch(5.0) == DDPConfig(5.0, 5.0)
    assert isinstance(simulate(balanced_profile(), Cluster(1, 1.0), DDPConfig()), SimResult)
