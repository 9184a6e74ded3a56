"""Where a search starts: the cost model's choice, then the settings the simulator predicts fastest
on the warm-up's timeline."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from commsched.layout.setting import LayoutSetting
from commsched.planning.cost_model import Timeline
from commsched.profiling.profile import LinkProfile, ParameterProfile, Profile
from commsched.strategy import Strategy
from commsched.tuning.space import SearchSpace


# ------------------------------------------------------------ starting point
@dataclass(frozen=True)
class TuningStart:
    """What warm-up gave rank 0: the layout it ended with and its timeline."""

    layout: LayoutSetting
    """The setting in use when warm-up ended: the configured one, with the cost model's partitioning."""
    timeline: Timeline | None
    """Rank 0's measured timeline and link (None when the cost model did not run)."""
    overlap_allowed: bool
    parameters: tuple[tuple[int, int], ...] = ()
    """Per slot: the gradient's elements and bytes per element (for the simulator)."""
    forward_order: tuple[int, ...] = ()
    """Slots in the order the forward pass first reads them."""
    world_size: int = 1


def starting_point(start: TuningStart) -> LayoutSetting:
    """The first trial: the layout warm-up ended with (the cost model's choice, with the configured
    bucket caps), forward overlap on where it may be.

    The hook for a better first guess: a function of the warm-up timeline that
    returns a setting. The simulator's ``best_strategy`` replayed on the same
    timeline (as a `commsched.profiling.profile.Profile`) can take this place.
    """
    return dataclasses.replace(start.layout, overlap_forward=start.overlap_allowed)


StartingPoint = Callable[[TuningStart], LayoutSetting]


SIMULATED_GUESSES = 3
"""Settings the simulator ranks best, measured right after the starting point."""


MAX_SIMULATED_SETTINGS = 1500
"""A larger space is thinned evenly before it is simulated (each simulation takes about a millisecond)."""


def warmup_profile(warmup: TuningStart) -> Profile | None:
    """The warm-up timeline as a `commsched.profiling.profile.Profile`, for the simulator; None without one.

    The timeline knows when each gradient was ready and how long the forward
    pass took, not when the forward pass first read each parameter: as the
    cost model does, it is taken to reach each parameter after the share of the
    forward pass equal to the share of parameter bytes read before it. The link
    is the one the cost model measured, with the collectives it runs at once;
    the CPU share of the transport stands in for the slowdown of computation
    beside it.
    """
    timeline = warmup.timeline
    if timeline is None or warmup.world_size < 2 or not warmup.parameters or not warmup.forward_order:
        return None
    sizes = warmup.parameters
    total = sum(numel * size for numel, size in sizes) or 1
    first_use, seen = {}, 0
    for slot in warmup.forward_order:
        first_use[slot] = timeline.forward_s * seen / total
        seen += sizes[slot][0] * sizes[slot][1]
    parameters = tuple(
        ParameterProfile(f"slot {slot}", numel, size, first_use.get(slot, timeline.forward_s),
                         timeline.slot_ready_s[slot])
        for slot, (numel, size) in enumerate(sizes)
    )
    link = LinkProfile(warmup.world_size, (), timeline.link.latency_s, timeline.link.bytes_per_s,
                       compute_slowdown=max(0.0, timeline.transport_cpu_share), in_flight=timeline.link.in_flight)
    return Profile("warm-up", "rank 0", 0, timeline.forward_s, max(timeline.slot_ready_s, default=0.0), 0.0,
                   parameters, link=link)


def simulated_guesses(warmup: TuningStart, space: SearchSpace, count: int = SIMULATED_GUESSES) -> list[LayoutSetting]:
    """The settings of ``space`` the simulator predicts fastest on the warm-up's timeline, the fastest
    for each of the ``count`` partition sizes predicted best (fastest first); none where there is
    no timeline to simulate."""
    from commsched.simulator import Cluster, simulate

    profile = warmup_profile(warmup)
    if profile is None or count < 1:
        return []
    cluster = Cluster.from_link(profile.link, workers=warmup.world_size)
    settings = list(space.grid())
    if len(settings) > MAX_SIMULATED_SETTINGS:
        step = len(settings) / MAX_SIMULATED_SETTINGS
        settings = [settings[int(i * step)] for i in range(MAX_SIMULATED_SETTINGS)]
    strategy = Strategy(adaptive=False)  # the tuner runs with priority on the all-reduce backend
    predicted: dict[tuple[object, ...], tuple[float, LayoutSetting]] = {}
    for setting in settings:
        key = setting.behaviour()
        if key not in predicted:
            predicted[key] = (simulate(profile, cluster, setting.applied(strategy)).iteration_s, setting)
    ranked = sorted(predicted.values(), key=lambda pair: pair[0])
    # One per partition size: neighbours of the best (another credit window) teach the optimiser little.
    guesses: list[LayoutSetting] = []
    for _, setting in ranked:
        if all(setting.partition_mb != g.partition_mb for g in guesses):
            guesses.append(setting)
        if len(guesses) == count:
            break
    return guesses
