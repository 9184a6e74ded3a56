"""The cost model picks the partitioning from a timeline: pure logic, no process group."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from commsched.layout.setting import LayoutSetting
from commsched.planning.cost_model import Setting, Timeline, applied, candidates, choose, predict
from commsched.planning.schedule import LinkModel
from commsched.strategy import MIB, MIN_BUCKET_MB, MIN_PARTITION_MB, AllReduce, Strategy

CONFIGURED = Setting(partition_mb=1.0, credit_mb=4.0)
WHOLE = Setting(None, None)


def layers(count: int = 8, numel: int = 2**18) -> list[torch.Tensor]:
    """``count`` float32 tensors of 1 MiB each, used in this order by the forward pass."""
    return [torch.empty(numel) for _ in range(count)]


def timeline(params, backward_s: float, forward_s: float, link: LinkModel) -> Timeline:
    """Gradients ready evenly over the backward pass, the output side (last used) first."""
    count = len(params)
    ready = [backward_s * (count - slot) / count for slot in range(count)]
    return Timeline(tuple(ready), forward_s, link)


def decide(params, line: Timeline, overlap: bool = True):
    strategy = Strategy(partition_mb=CONFIGURED.partition_mb, credit_mb=CONFIGURED.credit_mb, overlap_forward=overlap)
    return choose(LayoutSetting.of(strategy), strategy.priority, params, list(range(len(params))), line)


def test_candidates_are_configured_coarser_finer_and_whole_buckets_once():
    assert candidates(CONFIGURED) == [CONFIGURED, Setting(4.0, 16.0), Setting(0.5, 0.5), WHOLE]
    assert candidates(Setting(2.0, None)) == [Setting(2.0, None), Setting(8.0, None), Setting(1.0, 1.0), WHOLE]
    assert candidates(Setting(0.5, 0.5)) == [Setting(0.5, 0.5), Setting(2.0, 2.0), Setting(0.25, 0.25), WHOLE]
    assert candidates(WHOLE) == [WHOLE]


def test_no_candidate_is_smaller_than_a_strategy_accepts():
    """Tiny partitions and one bucket per tensor (a byte's cap) have no finer or smaller candidates."""
    tiny = Setting(MIN_PARTITION_MB, MIN_PARTITION_MB)
    assert candidates(tiny) == [tiny, Setting(4 * MIN_PARTITION_MB, 4 * MIN_PARTITION_MB), WHOLE]
    assert candidates(WHOLE, MIN_BUCKET_MB, MIB, MIN_BUCKET_MB) == [WHOLE, Setting(None, None, 4 * MIN_BUCKET_MB)]
    for setting in candidates(tiny, MIN_BUCKET_MB, MIB, MIN_BUCKET_MB):
        applied(Strategy(partition_mb=MIN_PARTITION_MB, credit_mb=MIN_PARTITION_MB, bucket_cap_mb=MIN_BUCKET_MB,
                         first_bucket_mb=MIN_BUCKET_MB), setting)  # a Strategy accepts each


def test_bucket_sizes_ddp_users_sweep_are_candidates_where_the_gradients_fill_more_than_one():
    five, one, hundred = (Setting(None, None, mb) for mb in (5.0, 1.0, 100.0))
    assert candidates(CONFIGURED, 25.0, 26 * MIB)[-1] == hundred
    assert candidates(WHOLE, 25.0, 26 * MIB) == [WHOLE, five, one, hundred]
    assert candidates(CONFIGURED, 25.0, 25 * MIB) == [*candidates(CONFIGURED), five, one]
    assert candidates(WHOLE, 25.0, 3 * MIB) == [WHOLE, one]
    assert candidates(WHOLE, 25.0, MIB) == [WHOLE]
    # without the small first bucket, where the gradients fill more than it
    # and each smaller size with the configured first bucket too, where that is smaller still
    assert candidates(WHOLE, 25.0, 26 * MIB, 1.0) == [
        WHOLE, five, Setting(None, None, 5.0, 1.0), one, Setting(None, None, 25.0), hundred]
    assert candidates(WHOLE, 25.0, 26 * MIB, 25.0) == [WHOLE, five, one, hundred]
    # a fifth and a twenty-fifth of what is configured
    assert candidates(WHOLE, 100.0, 26 * MIB) == [WHOLE, Setting(None, None, 20.0), Setting(None, None, 4.0)]
    # with sharded state, none above the configured size ([Note: a bucket's size bounds sharded state's memory])
    assert candidates(WHOLE, 25.0, 26 * MIB, 1.0, gathers=True) == [
        WHOLE, five, Setting(None, None, 5.0, 1.0), one, Setting(None, None, 25.0)]


def test_a_candidate_describes_and_lays_out_its_buckets():
    layout = LayoutSetting.of(Strategy())
    assert Setting(None, None, 5.0).describe() == "whole buckets of 5 MiB, the first too"
    assert Setting(None, None, 25.0, 1.0).describe() == "whole buckets of 25 MiB, the first 1 MiB"
    five = Setting(None, None, 5.0).on(layout)
    assert (five.partition_mb, five.bucket_cap_mb, five.first_bucket_mb) == (None, 5.0, 5.0)
    for setting in (Setting(None, None, 5.0), Setting(None, None, 25.0, 1.0), Setting(4.0, 16.0)):
        assert Setting.of(setting.on(layout)) == setting


def test_many_hosts_get_larger_buckets():
    """At 1024 hosts a ring all-reduce pays 2046 hops of 25 us, 51 ms per collective: 64 MiB of
    gradients in 25 MiB buckets cost three such latencies, in 100 MiB buckets one (torch DDP users
    raise bucket_cap_mb for this)."""
    params = layers(count=64)
    ring = LinkModel(latency_s=2046 * 25e-6, bytes_per_s=12.5e9)
    for overlap in (True, False):
        choice = decide(params, timeline(params, backward_s=0.2, forward_s=0.1, link=ring), overlap=overlap)
        assert choice.setting == Setting(None, None, 100.0), choice.reason
        assert "whole buckets of 100 MiB, the first too" in choice.reason


def test_collectives_in_flight_make_partitions_pay_among_many_hosts():
    """8 emulated hosts' link: 20 ms of fixed cost, 29 ms per MiB. One collective at a time, 1 MiB
    partitions pay 16 fixed costs one after the other and whole 5 MiB buckets win; two in flight
    (gloo), each runs in the other's gaps and the configured partitions win, their predicted wait
    halved ([Note: two collectives at once])."""
    params = layers(count=16)
    predictions = {}
    for in_flight, expected in ((1, Setting(None, None, 5.0, 1.0)), (2, CONFIGURED)):
        link = LinkModel(latency_s=0.02, bytes_per_s=36e6, in_flight=in_flight)
        choice = decide(params, timeline(params, backward_s=0.2, forward_s=0.1, link=link))
        assert choice.setting == expected, choice.reason
        predictions[in_flight] = {p.setting: p for p in choice.predictions}
    assert predictions[2][CONFIGURED].wait_s < predictions[1][CONFIGURED].wait_s / 2
    # Whole buckets are one collective each at the end of backward: nothing beside them to overlap.
    assert predictions[2][WHOLE].wait_s == predictions[1][WHOLE].wait_s


def test_a_fast_link_gets_fewer_collectives():
    """Communication hides behind compute anyway: fewer collectives cost less, down to one
    bucket without the small first one. (Whole buckets put the first layers' gradients into one
    large bucket that the next forward pass waits for, so on a merely fast link smaller buckets
    win: 5 MiB ones behind a 1 MiB first one, which the next forward pass waits for least.)"""
    params = layers()
    for bytes_per_s, expected in ((5e9, Setting(None, None, 5.0, 1.0)), (1e12, Setting(None, None, 25.0))):
        link = LinkModel(latency_s=2e-4, bytes_per_s=bytes_per_s)
        for overlap in (True, False):
            choice = decide(params, timeline(params, backward_s=0.2, forward_s=0.1, link=link), overlap=overlap)
            assert choice.setting == expected, choice.reason
            assert {p.setting for p in choice.predictions} == set(candidates(CONFIGURED, 25.0, 8 * MIB, 1.0))


def test_a_link_as_slow_as_compute_keeps_the_partitions():
    """8 MiB at 80 MiB/s take 100 ms, as long as the backward pass: whole buckets would
    send almost everything after it, partitions send it during it."""
    params = layers()
    balanced = LinkModel(latency_s=2e-4, bytes_per_s=80 * 2**20)
    for overlap in (True, False):
        choice = decide(params, timeline(params, backward_s=0.1, forward_s=0.05, link=balanced), overlap=overlap)
        assert choice.setting == CONFIGURED, choice.reason
        by_setting = {p.setting: p for p in choice.predictions}
        assert by_setting[CONFIGURED].wait_s < by_setting[WHOLE].wait_s
        assert by_setting[CONFIGURED].collectives > by_setting[WHOLE].collectives


def test_forward_overlap_hides_what_the_first_layers_do_not_need():
    """With overlap, only buckets needed before they arrive count as waiting."""
    params = layers()
    line = timeline(params, backward_s=0.02, forward_s=0.2, link=LinkModel(2e-4, 80 * 2**20))
    with_overlap = {p.setting: p.wait_s for p in decide(params, line, overlap=True).predictions}
    without = {p.setting: p.wait_s for p in decide(params, line, overlap=False).predictions}
    assert with_overlap[CONFIGURED] < without[CONFIGURED]


def test_the_reason_names_every_prediction():
    params = layers()
    choice = decide(params, timeline(params, 0.2, 0.1, LinkModel(2e-4, 1e12)))
    reason = choice.reason
    assert reason.startswith("whole buckets of 25 MiB, the first too: predicted ") and "for 1 collectives + " in reason
    assert "whole buckets: " in reason
    assert "partitions of 1 MiB, credit 4 MiB: " in reason and "partitions of 4 MiB, credit 16 MiB: " in reason


def test_communication_that_takes_the_cpu_hides_nothing():
    """On a link that is the host's CPU (loopback: every byte is copied by the
    process's own threads), what runs beside computation slows it as much as it
    would wait: fewer collectives win where partitions would win on a wire."""
    params = layers()
    balanced = LinkModel(latency_s=2e-4, bytes_per_s=80 * 2**20)
    line = timeline(params, backward_s=0.1, forward_s=0.05, link=balanced)
    on_a_wire = decide(params, line)
    on_the_cpu = decide(params, dataclasses.replace(line, transport_cpu_share=1.0))
    assert on_a_wire.setting == CONFIGURED, on_a_wire.reason
    assert on_the_cpu.setting != CONFIGURED, on_the_cpu.reason
    chosen = next(p for p in on_the_cpu.predictions if p.setting == on_the_cpu.setting)
    configured = next(p for p in on_the_cpu.predictions if p.setting == CONFIGURED)
    assert configured.contention_s > chosen.contention_s


def test_the_cheapest_whole_buckets_of_another_size_are_measured_beside_the_choice():
    """Whatever the choice and its runner-up, the best-predicted bucket size sent whole (what torch DDP's
    users would sweep for) goes to the check on measured iterations too, once."""
    params = layers()
    for bytes_per_s in (80 * 2**20, 5e9, 1e12):
        link = LinkModel(latency_s=2e-4, bytes_per_s=bytes_per_s)
        choice = decide(params, timeline(params, backward_s=0.2, forward_s=0.1, link=link), overlap=True)
        sized = sorted((p for p in choice.predictions if p.setting.partition_mb is None
                        and p.setting.bucket_cap_mb is not None
                        and p.setting not in (choice.setting, choice.runner_up)),
                       key=lambda p: (round(p.cost_s, 6), p.collectives))
        assert choice.best_whole == sized[0].setting, choice.reason
        assert choice.best_whole.bucket_cap_mb is not None and choice.best_whole.partition_mb is None


def test_the_runner_up_is_the_cheapest_other_partitioning():
    """Whether the choice is partitions or whole buckets, the check measures the best-predicted other
    partitions beside it ([Note: confirming the choice]): a prediction that ranks them a few percent
    behind whole buckets must not keep them from being measured."""
    params = layers()
    for bytes_per_s in (80 * 2**20, 5e9, 1e12):
        link = LinkModel(latency_s=2e-4, bytes_per_s=bytes_per_s)
        choice = decide(params, timeline(params, backward_s=0.2, forward_s=0.1, link=link), overlap=True)
        partitioned = sorted((p for p in choice.predictions if p.setting.partition_mb is not None
                              and p.setting != choice.setting), key=lambda p: (round(p.cost_s, 6), p.collectives))
        assert choice.runner_up == partitioned[0].setting, choice.reason


def test_sharded_state_pays_the_fixed_cost_of_each_gathered_bucket():
    """With sharded optimizer state each bucket's parameters are all-gathered, one bucket at a time
    ([Note: one all-gather at a time]): each gathered bucket costs the link's fixed cost, the small
    bucket the forward pass needs first excepted where it is kept whole (at most 1 MiB). Of eight
    1 MiB tensors, whole 1 MiB buckets gather 7; 5 MiB ones behind a 1 MiB first bucket (the
    output side's) gather 3, the input side's 2 MiB included."""
    params = layers()
    link = LinkModel(latency_s=5e-3, bytes_per_s=80 * 2**20)
    line = timeline(params, backward_s=0.2, forward_s=0.1, link=link)
    small, large = Setting(None, None, 1.0, None), Setting(None, None, 5.0, 1.0)
    plain = LayoutSetting.of(Strategy())
    sharded = LayoutSetting.of(Strategy(backend=AllReduce(shard_optimizer=True)))
    assert not plain.gathers and sharded.gathers

    def cost(setting, layout):
        return predict(setting, params, list(range(len(params))), layout, True, line)

    for setting, gathers in ((small, 7), (large, 3)):
        assert cost(setting, plain).gathers == 0
        assert cost(setting, sharded).gathers == gathers
        assert cost(setting, sharded).cost_s == pytest.approx(cost(setting, plain).cost_s + gathers * 5e-3)
    one_bucket = Setting(None, None, 25.0, None)
    assert cost(one_bucket, sharded).gathers == 1, "the only bucket is sharded, whatever its size"
    strategy = Strategy(backend=AllReduce(shard_optimizer=True))
    choice = choose(LayoutSetting.of(strategy), True, params, list(range(len(params))), line)
    assert "all-gathers" in choice.reason
