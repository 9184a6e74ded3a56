"""What a `Strategy` runs as, predicted from a profile: the cost model's choice made ahead of time.

A run with ``Strategy(adaptive=True)`` (the default) does not keep its
configured partitions: at the end of warm-up its cost model
(`commsched.planning.cost_model`) picks among them, coarser ones and whole buckets on
the measured timeline and link. The simulator takes a Strategy literally, so
simulating ``Strategy()`` on a large ring would charge it for 1 MiB partitions
that the run would never use (each costs 2(N-1) hops). `as_run` makes the same
choice from a `Profile` and a simulated `Cluster`, and, as a run measures chosen
partitions against whole buckets and keeps the faster
(`commsched.tuning.confirmation`), simulates both, so that ``commsched plan``
shows what the defaults really do.
"""

from __future__ import annotations

import dataclasses

from commsched.layout.setting import LayoutSetting
from commsched.planning.cost_model import MIN_CONFIRMATION_MARGIN, Choice, Timeline, applied, choose, measured_choice
from commsched.planning.schedule import LinkModel
from commsched.profiling.profile import Profile
from commsched.simulator import Cluster, meta_parameters, simulate
from commsched.strategy import Strategy


def cost_model_choice(strategy: Strategy, profile: Profile, cluster: Cluster) -> Choice:
    """The cost model's choice for ``strategy`` on ``profile``'s timeline and ``cluster``'s link."""
    params = meta_parameters(profile)
    measured = cluster.link_profile()  # what measuring the cluster's all-reduce would give
    link = LinkModel(latency_s=measured.latency_s, bytes_per_s=measured.bytes_per_s, in_flight=cluster.in_flight)
    timeline = Timeline(
        slot_ready_s=tuple(p.ready_s for p in profile.parameters),
        forward_s=profile.forward_s,
        link=link,
        transport_cpu_share=min(1.0, cluster.compute_slowdown),
    )
    return choose(LayoutSetting.of(strategy), strategy.priority, params, profile.forward_order, timeline)


def as_run(strategy: Strategy, profile: Profile, cluster: Cluster) -> Strategy:
    """``strategy`` with the partitioning a run on ``cluster`` would adopt, and ``adaptive=False``.

    Unchanged (but for ``adaptive``) where the run keeps its configured
    values: ``adaptive=False``, no priority, parameter servers, auto-tuning
    (which searches instead), or a single worker (nothing to reduce).
    """
    literal = dataclasses.replace(strategy, adaptive=False)
    if not strategy.cost_model_picks_partitioning or strategy.autotune or cluster.workers < 2:
        return literal
    choice = cost_model_choice(strategy, profile, cluster)
    chosen = applied(literal, choice.setting)
    whole = dataclasses.replace(literal, partition_mb=None, credit_mb=None)
    if chosen == whole or not strategy.measures_its_choice:
        return chosen
    # The run then measures its choice, the runner-up and the best whole buckets against the configured
    # buckets sent whole and keeps the fastest ([Note: confirming the choice]); here the simulator measures,
    # and its trials of one setting agree exactly: the smallest margin, as on a quiet cluster.
    measured = [chosen, whole] + [applied(literal, s) for s in (choice.runner_up, choice.best_whole) if s is not None]
    return measured_choice({s: simulate(profile, cluster, s).iteration_s for s in measured}, whole,
                           MIN_CONFIRMATION_MARGIN, LayoutSetting.of)
