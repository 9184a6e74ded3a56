"""`commsched.simulator.adoption`: simulating ``Strategy()`` as a run adopts it, not literally."""

from __future__ import annotations

import dataclasses

import pytest

from commsched.planning.cost_model import MIN_CONFIRMATION_MARGIN, Setting, candidates
from commsched.simulator import Cluster, DDPConfig, simulate
from commsched.simulator.adoption import as_run, cost_model_choice
from commsched.strategy import ParameterServer, Strategy
from commsched.testing.profiles import balanced_profile


def test_a_large_ring_adopts_coarse_collectives_and_is_not_slower_than_ddp():
    """1 MiB partitions cost 2(N-1) hops each: at 64 workers they are several times DDP's time.
    The run's cost model does not keep them, and the plan must not say it does."""
    profile = balanced_profile()
    cluster = Cluster(workers=64, gbit_s=100)
    ddp = simulate(profile, cluster, DDPConfig()).iteration_s
    literal = simulate(profile, cluster, Strategy(adaptive=False)).iteration_s
    adopted = as_run(Strategy(), profile, cluster)
    assert literal > 1.15 * ddp  # what the literal defaults would cost
    assert adopted.partition_mb is None or adopted.partition_mb > Strategy().partition_mb
    assert not adopted.adaptive
    assert simulate(profile, cluster, adopted).iteration_s <= 1.02 * ddp


def test_a_slow_link_with_two_workers_keeps_partitions():
    """Where the next forward pass would wait for the link, urgent partitions pay for their hops:
    the configured ones, or coarser ones within the margin of them (a tie goes to fewer
    collectives, as a run's check decides)."""
    profile = balanced_profile()
    cluster = Cluster(workers=2, gbit_s=1)
    adopted = as_run(Strategy(), profile, cluster)
    assert adopted.partition_mb is not None and adopted.partition_mb >= Strategy().partition_mb
    configured = simulate(profile, cluster, Strategy(adaptive=False)).iteration_s
    assert simulate(profile, cluster, adopted).iteration_s <= configured * (1 + MIN_CONFIRMATION_MARGIN)
    assert simulate(profile, cluster, adopted).iteration_s < simulate(profile, cluster, DDPConfig()).iteration_s


def test_the_choice_lists_every_candidate_with_a_reason():
    profile = balanced_profile()
    choice = cost_model_choice(Strategy(), profile, Cluster(workers=8, gbit_s=10))
    assert [p.setting for p in choice.predictions] == candidates(
        Setting(1.0, 4.0), Strategy().bucket_cap_mb, profile.gradient_bytes, Strategy().first_bucket_mb)
    assert choice.setting in {p.setting for p in choice.predictions}
    assert "predicted" in choice.reason


@pytest.mark.parametrize("strategy", [
    Strategy(adaptive=False),
    Strategy(priority=False),
    Strategy(backend=ParameterServer(num_servers=1)),
    Strategy(autotune=True),
], ids=["not adaptive", "no priority", "parameter servers", "auto-tuned"])
def test_strategies_the_cost_model_does_not_touch_are_taken_literally(strategy):
    adopted = as_run(strategy, balanced_profile(), Cluster(workers=64, gbit_s=100, servers=1))
    assert adopted == dataclasses.replace(strategy, adaptive=False)


def test_one_worker_is_taken_literally():
    assert as_run(Strategy(), balanced_profile(), Cluster(workers=1, gbit_s=10)) == Strategy(adaptive=False)
