"""Warm-up: what the first iterations record, and what the engine decides from it when they end.

From ``prepare()`` to the first synchronised pass after `WARMUP_ITERATIONS`:

- the first forward pass that records gradients reveals the order parameters
  are used in and those read before their module ran
  (`commsched.watch.first_forward`); rank 0's order is agreed and the engine
  lays out its buckets;
- the warm-up iterations run without forward overlap while the loop's reads
  outside the forward pass are watched (`commsched.watch.reads`) and, with
  priority, rank 0's timeline is profiled (`ReadyTimeProfile`);
- at the end of the last profiled backward pass every rank times the link
  (`commsched.planning.calibration`);
- `Warmup.finish` lets the cost model choose the partitioning on rank 0 and
  hands back one `WarmupResult`, from which the engine lays out, plans and
  starts forward overlap (or not).

While the forward passes are recorded, a compiled model runs them eagerly
(`commsched.watch.parameter_use.EagerForward`; [Note: recording and
torch.compile]); it is compiled from the first forward pass after the last
recorded one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from commsched.comm.transport import Transport
from commsched.device import HostSeam
from commsched.engine.backward_pass import BackwardPass
from commsched.engine.config import RunConfig
from commsched.engine.events import EventBus
from commsched.engine.groups import ProcessGroups
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.engine.ready_times import ReadyTimeProfile
from commsched.layout.compiled_gates import see_gates_when_compiled
from commsched.layout.grad_layout import GradLayout
from commsched.planning.calibration import Calibration, calibrate
from commsched.planning.cost_model import Choice, Timeline
from commsched.planning.plans import WarmupTimeline, choose_on_rank0
from commsched.strategy import MIB
from commsched.watch.first_forward import FirstForward, agree_on_order
from commsched.watch.parameter_use import EagerForward
from commsched.watch.reads import ParameterReads
from commsched.errors import failures_explained

OrderFound = Callable[[list[int], dict[int, torch.nn.Module]], None]
"""Called with the agreed forward order and the parameters read before their module ran."""


@dataclass(frozen=True)
class WarmupResult:
    """What warm-up decided and measured, for the rest of the run."""

    choice: Choice | None
    """The cost model's choice (its reasons on rank 0 only); None where it did not run."""
    timeline: WarmupTimeline | None
    """What plans for any layout are made from; None without priority (no profile)."""
    cost_timeline: Timeline | None
    """Rank 0's timeline as the cost model saw it (None elsewhere, and where it did not run)."""
    reads: ParameterReads | None
    """The reads of the loop seen during warm-up (None where forward overlap was never possible)."""


class Warmup:
    """The warm-up's recordings: the first forward pass, the loop's reads, rank 0's profile, the link."""

    def __init__(
        self,
        module: torch.nn.Module,
        params: Sequence[torch.nn.Parameter],
        config: RunConfig,
        events: EventBus,
        groups: ProcessGroups,
        transport: Transport,
        order_found: OrderFound,
        clock: HostSeam,
    ):
        """``clock``: the gradients' device's, which times the profile and the link's calibration."""
        self._module, self._params, self._config = module, params, config
        self._clock = clock
        self._events, self._groups, self._transport = events, groups, transport
        self._order_found = order_found
        self._first_forward: FirstForward | None = None
        self._profile: ReadyTimeProfile | None = None
        self._calibration: Calibration | None = None
        """The link, measured at the end of warm-up's last profiled pass (`pass_ended`)."""
        self.reads: ParameterReads | None = None
        self.finished = False
        self._layout_known = False
        self._eager: EagerForward | None = EagerForward(module)
        """Until no forward pass is left to record."""

    # ------------------------------------------------------- the first forward
    def record_first_forward(self) -> None:
        """A forward pass that records gradients begins and there is no layout yet: record it."""
        if self._first_forward is None:
            self._first_forward = FirstForward(self._module, self._params, self._first_forward_ended)

    def _first_forward_ended(self, order: list[int], read_before_owner: dict[int, torch.nn.Module]) -> None:
        self._first_forward = None
        with failures_explained(self._transport.explain_failure):
            order = agree_on_order(order, self._groups.control, self._config.timeout_s)
        self._order_found(order, read_before_owner)

    # ---------------------------------------------------------- the iterations
    def layout_built(self, gates_of_slots: Sequence[Sequence[torch.nn.Module]] | None) -> None:
        """The buckets exist: profile (with priority) and, where forward overlap is possible
        (``gates_of_slots``: per slot, the modules whose gate waits for it), watch the loop's reads."""
        if self._config.priority:
            self._profile = ReadyTimeProfile(len(self._params), self._clock)
            self._events.subscribe(self._profile)
        if gates_of_slots is not None:
            self.reads = ParameterReads(self._module, self._params, gates_of_slots)
        self._layout_known = True
        self._compile_when_recorded()

    def before_step(self) -> None:
        if self.reads is not None:
            self.reads.stop()

    def after_step(self, warming_up: bool) -> bool:
        """Watch the reads until the next ``step()`` while ``warming_up``; True once nothing is left to do."""
        reads = self.reads
        if reads is not None:
            if warming_up:
                reads.start()
            elif not reads.active:
                self.reads = None
        self._compile_when_recorded()
        return self.finished and self.reads is None

    def _compile_when_recorded(self) -> None:
        """Once no forward pass is left to record, a compiled model runs compiled again."""
        if self._eager is not None and self._layout_known and self.reads is None:
            if self._config.overlap_requested:
                see_gates_when_compiled(self._module)  # [Note: dynamo and module hooks]
            self._eager.detach()
            self._eager = None

    def pass_ended(self, finished: BackwardPass, layout: GradLayout) -> None:
        """At the end of warm-up's last profiled pass, its reductions complete: time the link for the
        plan (and the cost model), while memory is lowest (see `calibrate`). Collective: every rank
        ends that pass, a rank out of batches in its shadow iteration."""
        if self._profile is None or finished.iteration != WARMUP_ITERATIONS - 1:
            return
        with failures_explained(self._transport.explain_failure):
            self._calibration = self._calibrate(layout)

    def _calibrate(self, layout: GradLayout) -> Calibration:
        """Time the link (collective); where the first bucket may go in two steps, from now on it
        does if they timed faster (see [Note: an all-reduce in two steps])."""
        two_steps = self._transport.two_steps
        calibration = calibrate(layout, self._groups.replicas, self._config.timeout_s, self._config.adaptive,
                                None if two_steps is None else two_steps.second_steps,
                                int(self._config.layout.first_bucket_mb * MIB), clock=self._clock)
        timing = calibration.two_step
        if timing is not None and two_steps is not None:
            two_steps.use(timing.nbytes if timing.pays else 0, timing.describe())
        return calibration

    def finish(self, layout: GradLayout) -> WarmupResult:
        """At the first pass after warm-up: the cost model's choice (collective where it runs)."""
        self.finished = True
        profile, config = self._profile, self._config
        if profile is None:
            return WarmupResult(None, None, None, self.reads)
        with failures_explained(self._transport.explain_failure):
            calibration = self._calibration or self._calibrate(layout)
            self._calibration = None
            timeline = profile.timeline(calibration.latency_s)
            choice = cost_timeline = None
            if config.adaptive:
                choice, cost_timeline = choose_on_rank0(layout, timeline, calibration, config.layout, config.priority,
                                                        self._groups.control, config.timeout_s)
        self._events.unsubscribe(profile)
        self._profile = None
        idle_link = cost_timeline.link if cost_timeline is not None else None
        # Anew with the idle link: it tells which warm-up iterations say how fast the link is.
        return WarmupResult(choice, profile.timeline(calibration.latency_s, idle_link), cost_timeline, self.reads)

    def close(self) -> None:
        if self.reads is not None:
            self.reads.stop()
            self.reads = None
        if self._eager is not None:
            self._eager.detach()
            self._eager = None
