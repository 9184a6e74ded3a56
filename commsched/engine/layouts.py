"""The buckets and the plan a model's passes use, and the points where they change.

A layout is built once the first forward pass gave the order parameters are
used in. It may change at two kinds of points, always at the start of a
synchronised pass and at the same iteration on every rank: the end of
warm-up (the cost model's choice of partitioning, reduce-scatter's layout,
rank 0's plan, the start of tuning or of the choice's check) and the tuner's
switch points. Each change lays the buckets out anew, moves the gradients
accumulated so far, places the gates again and agrees on a plan. The reducer
asks this object at those points and hands each pass what it holds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from commsched.comm.transport import Transport
from commsched.engine.config import RunConfig
from commsched.engine.events import EventBus
from commsched.engine.gating import ForwardGating
from commsched.engine.groups import ProcessGroups
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.engine.overlap import ForwardOverlap
from commsched.engine.tuning import TuningSession, autotuner, confirmation
from commsched.engine.warmup import WarmupResult
from commsched.layout.grad_layout import GradLayout, build_layout
from commsched.layout.partitions import Plan, fifo_plan
from commsched.layout.setting import LayoutSetting
from commsched.planning.cost_model import Choice
from commsched.planning.plans import WarmupTimeline, bucket_ready_s, plan_on_rank0
from commsched.tuning.confirmation import describe as confirmation_reason
from commsched.tuning.confirmation import whole_buckets
from commsched.tuning.guesses import TuningStart
from commsched.update.base import UpdatePolicy
from commsched.errors import failures_explained

logger = logging.getLogger("commsched")


class LayoutInUse:
    """The `RunConfig` (whose layout setting may change), the `GradLayout`, the agreed `Plan`, and the
    cost model's choice and the tuning session that change them."""

    def __init__(self, names: Sequence[str], params: Sequence[torch.nn.Parameter], config: RunConfig,
                 transport: Transport, policy: UpdatePolicy, groups: ProcessGroups, gating: ForwardGating,
                 overlap: ForwardOverlap, events: EventBus):
        self._names, self._params = list(names), list(params)
        self._transport, self._policy, self._groups = transport, policy, groups
        self._gating, self._overlap, self._events = gating, overlap, events
        self.config = config
        self.layout: GradLayout | None = None
        self.plan: Plan | None = None
        self.choice: Choice | None = None
        """The cost model's choice (its reasons on rank 0 only), once made."""
        self.tuning: TuningSession | None = None
        """With ``Strategy(autotune=True)``, from the end of warm-up on; or while the cost model's
        partitions are measured against whole buckets (`confirming`)."""
        self.confirming: tuple[LayoutSetting, LayoutSetting] | None = None
        """The cost model's choice and the configured buckets sent whole, where the two are (or were)
        measured against each other; see [Note: confirming the choice] in `commsched.tuning.confirmation`."""
        self._timeline: WarmupTimeline | None = None
        """What plans for a new layout are made from, kept from warm-up."""
        self.repeated_slots: frozenset[int] | None = None
        """Slots whose buckets are issued only at the end of backward (None: all, until
        a first pass was seen); see [Note: nested backward passes]."""

    @property
    def overlap_off_reason(self) -> str | None:
        """Why forward overlap is (or will be) off under the layout setting in use; None while it is on or possible."""
        return self._overlap.off_reason(self.config.layout)

    def first(self, forward_order: list[int], read_before_owner: dict[int, torch.nn.Module]) -> bool:
        """The first layout, once the forward order is known. Returns whether forward overlap is
        still possible (warm-up then watches the loop's reads)."""
        self._gating.readers_found(read_before_owner)
        self._relayout(forward_order)
        return self.overlap_off_reason is None and self._overlap.updates_per_bucket

    def rebuild(self) -> None:
        """The transport changed before any iteration: the layout, if made already, is made again."""
        if self.layout is not None:
            self._relayout(self.layout.forward_order)

    def _relayout(self, forward_order: Sequence[int]) -> None:
        """Buckets, partitions and gates for the layout in use; gradients move into the new buckets."""
        config, transport = self.config, self._transport
        self._gating.remove_gates()
        if self.layout is not None:
            # Let go of the old buckets first: with the activations of a forward pass
            # alive, old and new buffers together would raise the peak memory by one
            # copy of every gradient. (Gradients still in them move bucket by bucket.)
            # Nothing that holds them is in a reference cycle (a finished pass lets go
            # of its dispatcher's launch), so they go here, without a collection.
            self.layout = None
            self._policy.detach()
        layout = build_layout(
            self._names, self._params, forward_order, config.bucket_size_limits_bytes, transport.sums_usage_flags,
            lambda bucket_set: transport.attach(bucket_set, config.partition_bytes),
            verdict_slots=transport.world_size if config.check_finite else 0,
            chunk_padding=1 if transport.scatter is None else transport.scatter.chunk_padding,
        )
        self.layout = layout
        self.plan = Plan(layout.partitions, tuple(fifo_plan(layout.partitions)), config.credit_bytes)
        self._policy.attach(layout)
        if self.overlap_off_reason is None:
            self._gating.install(layout)
        self._events.layout_built(layout, transport.describe().placement)

    def after_warmup(self, result: WarmupResult, scattering: bool) -> tuple[int, ...] | None:
        """At the first iteration after warm-up: the cost model's choice, the plan, tuning or the choice's
        check (``scattering``: buckets are reduce-scattered from now on). Returns the new plan's order if
        there is one; forward overlap is on from here if `overlap_off_reason` is None."""
        started = time.perf_counter()
        self.choice = result.choice
        new_order = None
        configured = self.config.layout
        relaid = result.timeline is not None and result.choice is not None and self._use_partitioning(result.choice)
        if scattering and not relaid:
            self._relayout(self.layout.forward_order)
        if result.timeline is not None:
            self._timeline = result.timeline
            self.plan = self._agree_on_plan()
            new_order = self.plan.order
            logger.info("commsched: agreed on an order of %d partitions in %d buckets in %.1f ms",
                        len(new_order), len(self.layout.buckets), (time.perf_counter() - started) * 1e3)
        if result.reads is not None and self.overlap_off_reason is None:
            self._gating.use_recorded_reads(result.reads, self.layout)
        if self.config.tuning is not None and self._timeline is not None:
            self.tuning = self._start_tuning(result)
        elif (self.config.measures_choice and result.choice is not None
              and self.config.layout != whole_buckets(configured)):
            # Every rank knows the chosen setting, so every rank starts the same switch points.
            self.confirming = (self.config.layout, whole_buckets(configured))
            beside = [s.on(configured) for s in (result.choice.runner_up, result.choice.best_whole) if s is not None]
            self.tuning = TuningSession(confirmation(*self.confirming, beside), self._groups, self._transport,
                                        self.config.timeout_s, "the check of the cost model's choice of layout")
        if self.tuning is not None:
            new_order = self.switch_point(WARMUP_ITERATIONS) or new_order
        return new_order

    def _use_partitioning(self, choice: Choice) -> bool:
        """Lay the buckets out anew if the cost model chose another partitioning; True if so.

        Runs at the first gradient of the first iteration after warm-up, on every
        rank (the choice is rank 0's), before that pass's state exists: the
        reductions of the previous pass are complete and its updates applied, and
        the gradients accumulated so far move into the new buckets.
        """
        chosen = choice.setting.on(self.config.layout)
        if chosen == self.config.layout:
            return False
        self.config = self.config.with_layout(chosen)
        self._relayout(self.layout.forward_order)
        logger.info("commsched: %d buckets, %d partitions from now on: %s", len(self.layout.buckets),
                    len(self.layout.partitions), choice.reason)
        return True

    def _agree_on_plan(self) -> Plan:
        """Rank 0's plan for the layout in use, from the warm-up's timeline (collective); without forward
        overlap, the order the buckets become ready ([Note: a plan without urgency])."""
        timeline, layout = self._timeline, self.layout
        ready = bucket_ready_s(timeline.slot_ready_s, layout, self.held_buckets() or frozenset())
        with failures_explained(self._transport.explain_failure):
            return plan_on_rank0(layout.partitions, ready, timeline, self.config.credit_bytes, self._groups.control,
                                 self.config.timeout_s, overlapping=self.overlap_off_reason is None)

    def _start_tuning(self, warmup: WarmupResult) -> TuningSession:
        allowed = self.config.overlap_requested and self._overlap.blocked is None
        start = TuningStart(self.config.layout, warmup.cost_timeline, allowed,
                            tuple((p.numel(), p.element_size()) for p in self._params),
                            tuple(self.layout.forward_order), dist.get_world_size(self._groups.replicas))
        gradient_bytes = sum(p.numel() * p.element_size() for p in self._params)
        return TuningSession(autotuner(self.config.tuning, start, gradient_bytes), self._groups, self._transport,
                             self.config.timeout_s, "Strategy(autotune=True)")

    def switch_point(self, iteration: int) -> tuple[int, ...] | None:
        """[Note: auto-tuning] The setting rank 0 decided, laid out and planned on every rank.

        Runs where `_use_partitioning` runs (the start of a synchronised pass,
        before its state exists), on every rank at the same iteration. Returns
        the new plan's order if the layout or forward overlap changed.
        """
        layout_before, overlap_before = self.config.layout.layout(), self.overlap_off_reason
        setting = self.tuning.switch_point(iteration, self.config.layout)
        self.config = self.config.with_layout(setting)
        if setting.layout() == layout_before and self.overlap_off_reason == overlap_before:
            return None
        self._relayout(self.layout.forward_order)
        self._gating.map_reads(self.layout)
        self.plan = self._agree_on_plan()
        why = (confirmation_reason(self.tuning.log, *self.confirming) if self.confirming is not None
               else self.tuning.log.describe())
        logger.info("commsched: %s from iteration %d on (%s): %d buckets, %d partitions", setting.describe(),
                    iteration, why, len(self.layout.buckets), len(self.layout.partitions))
        return self.plan.order

    def may_change(self, iteration: int) -> bool:
        """Whether the pass of ``iteration`` may lay the buckets out anew (the end of warm-up, a tuning switch)."""
        return iteration == WARMUP_ITERATIONS or (self.tuning is not None and self.tuning.switches_at(iteration))

    def held_buckets(self) -> frozenset[int] | None:
        """Buckets issued only at the end of backward; see [Note: nested backward passes]."""
        if self.repeated_slots is None:
            return None
        return frozenset(self.layout.bucket_of[slot] for slot in self.repeated_slots)
