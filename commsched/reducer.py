"""The gradient reducer: one per prepared model, it wires the parts and follows the lifecycle.

Flow of one gradient (docs/architecture.md has the whole picture):
gradient hook (here) -> `BackwardPass.gradient_ready` -> a complete bucket ->
`Dispatcher` (plan order, credit) -> `Transport.launch` -> `Handle` completes ->
`BackwardPass` completes the bucket -> `UpdatePolicy.update` (at ``step()``
without overlap, at the module's `ForwardGates` gate with it).

The reducer itself holds what lasts across iterations: the frozen
`GradLayout`, the agreed `Plan`, the `Lifecycle`, and the current
`BackwardPass`. Iteration state lives in the pass; trace and planning profile
are observers of the events it emits.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.utils._pytree import tree_leaves

from commsched.autograd_context import inside_outer_backward, running_backward
from commsched.autotune import (
    Controller, Decision, Phase as TuningPhase, SearchSpace, TunedSetting, TuningConfig, TuningLog, Warmup,
    simulated_guesses, starting_point,
)
from commsched.backward_pass import BackwardPass, IterationFigures
from commsched.completion import CallbackTracker
from commsched.consistency import broadcast_from, broadcast_from_rank0
from commsched.control import forget_destroyed, forget_side_groups, takes_cpu_tensors
from commsched.cost_model import Choice, Setting, Timeline, applied
from commsched.errors import CommunicationTimeout
from commsched.events import EventBus
from commsched.gates import ForwardGates
from commsched.grad_scaling import GRAD_SCALER_REASON, GradScaling
from commsched.guards import (
    BACKWARD_UNFINISHED, GRADIENTS_CHANGED_REASON, ParameterFingerprint, check_gradient_kind,
    grad_scaler_after_warmup_error, gradients_touched_error, synchronize_during_backward_error,
)
from commsched.join import highest_rank_still_training
from commsched.layout import GradLayout, build_layout, gating_modules
from commsched.lifecycle import WARMUP_ITERATIONS, Lifecycle, Phase
from commsched.order import FirstForward, agree_on_order
from commsched.planning import (
    Calibration, ReadyTimeProfile, WarmupTimeline, agree_on_decision, bucket_ready_s, calibrate, choose_on_rank0,
    plan_on_rank0,
)
from commsched.reads import ParameterReads
from commsched.scheduler import Plan, fifo_plan
from commsched.strategy import Strategy
from commsched.trace import Tracer
from commsched.transport.base import Transport
from commsched.update.base import UpdatePolicy
from commsched.views_ahead import hand_out_views, sparse_gradient_slots, take_back

logger = logging.getLogger("commsched")

ONE_REPLICA_REASON = "one replica: there is no reduction to hide, so every bucket is updated at step()"

FAILED_DRAIN_S = 2.0
"""After a communication failure, how long the shutdown lets operations still in flight finish."""

TUNED_OVERLAP_OFF = "the auto-tuner's setting in use has forward overlap off"


class GradientReducer:
    """Hooks, layout, lifecycle and the current backward pass of one prepared model."""

    def __init__(
        self,
        module: torch.nn.Module,
        strategy: Strategy,
        transport: Transport,
        policy: UpdatePolicy,
        process_group: dist.ProcessGroup,
        buffer_group: dist.ProcessGroup | None = None,
        control_group: dist.ProcessGroup | None = None,
    ):
        self.module = module
        self.strategy = strategy
        self.transport = transport
        self.policy = policy
        self.process_group = process_group
        """The replicas: the link is measured on it."""
        self.buffer_group = buffer_group or process_group
        self.control_group = control_group or process_group
        """Order, choice and plan agreements; see [Note: control messages] in commsched/control.py."""
        self.lifecycle = Lifecycle.RECORDING
        self.effective_strategy = strategy
        """The strategy in use: ``strategy`` with the partitioning the cost model chose
        at the end of warm-up (see [Note: the cost model]), or the setting the
        auto-tuner has in use (see [Note: auto-tuning])."""
        self.tuning: TuningLog | None = TuningLog() if strategy.autotune else None
        """With ``Strategy.autotune``: the decisions so far, the same on every rank."""
        self._controller: Controller | None = None
        """Rank 0's auto-tuner, from the end of warm-up on."""
        self._warmup: WarmupTimeline | None = None
        """What plans for a new layout are made from, kept from warm-up."""
        self._read_slots: tuple[frozenset[int], frozenset[int]] | None = None
        """Slots the loop reads before and after the forward pass (seen during warm-up)."""
        self.choice: Choice | None = None
        """The cost model's choice (its reasons on rank 0 only), once made."""
        self.layout: GradLayout | None = None
        self.plan: Plan | None = None
        self.current: BackwardPass | None = None
        """The latest synchronised backward pass (its updates may still be pending)."""
        self.previous_figures: IterationFigures | None = None
        self.updated_at_step: tuple[int, ...] = ()
        """Buckets the loop reads between ``step()`` and the next forward pass: with
        overlap, updated at ``step()``. See [Note: reads outside the forward pass]."""
        self.updated_after_forward: tuple[int, ...] = ()
        """Buckets the loop reads after the forward pass: updated when it returns."""
        self.gated_at_forward_start: tuple[str, ...] = ()
        """Parameters a warm-up forward pass read before their gates: see [Note: reads before the gate]."""
        self._repeated_slots: frozenset[int] | None = None
        """Slots whose buckets are issued only at the end of backward (None: all, until
        a first pass was seen); see [Note: nested backward passes]."""
        self._read_before_owner: dict[int, torch.nn.Module] = {}
        """Per slot the first forward pass read before its module ran, the module that read it;
        the root for those a warm-up pass read before their gate ([Note: reads before the gate])."""

        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._phase = Phase.IDLE
        self._end_deferred = False
        """The backward pass's end-of-pass callback ran in a nested backward pass
        before every gradient was in; see [Note: nested backward]."""
        self._sync_enabled = True
        self._overlap_blocked = policy.overlap_blocker
        if strategy.overlap_forward and self._overlap_blocked:
            logger.warning("commsched: overlap_forward is off: %s", self._overlap_blocked)
        elif transport.is_local:
            # Nothing to hide: gates and deferred updates would only cost time.
            self._overlap_blocked = ONE_REPLICA_REASON

        self._events = EventBus()
        self._tracker = CallbackTracker()
        self._profile: ReadyTimeProfile | None = None
        self._calibration: Calibration | None = None
        """The link, measured at the end of warm-up's last profiled pass (`_calibrate_after`)."""
        self._first_forward: FirstForward | None = None
        self._gates: ForwardGates | None = None
        self._reads: ParameterReads | None = None
        self._fingerprint = ParameterFingerprint(module)
        self._modules = list(module.modules())
        if strategy.trace_dir is not None:
            self._events.subscribe(
                Tracer(strategy.trace_dir, dist.get_rank(process_group), module, self._params, self._tracker)
            )
        self._hooks = [
            param.register_post_accumulate_grad_hook(self._gradient_hook(slot))
            for slot, param in enumerate(self._params)
        ]
        self._hooks.append(module.register_forward_pre_hook(self._before_forward))
        self._hooks.append(module.register_forward_hook(self._arm_views_ahead))
        self._sparse_slots = sparse_gradient_slots(module, self._params)
        self._views_handed: frozenset[int] = frozenset()
        """Slots handed their views as the coming backward pass starts (see [Note: views ahead of backward])."""
        atexit.register(_at_exit, weakref.ref(self))
        if not strategy.priority:
            # Registration order reversed approximates the order gradients are produced.
            self._build(list(range(len(self._params))), {})

    # ------------------------------------------------------------------ state
    @property
    def overlap_off_reason(self) -> str | None:
        """Why forward overlap is (or will be) off; None while it is on or still possible."""
        if not self.strategy.overlap_forward:
            return "Strategy(overlap_forward=False)"
        if self._overlap_blocked:
            return self._overlap_blocked
        if not self.effective_strategy.overlap_forward:
            return TUNED_OVERLAP_OFF
        return None

    def _build(self, forward_order: list[int], read_before_owner: dict[int, torch.nn.Module]) -> None:
        """Fix the layout; start warm-up."""
        self._read_before_owner = dict(read_before_owner)
        self._lay_out(forward_order)
        if self.strategy.priority:
            self._profile = ReadyTimeProfile(len(self._params))
            self._events.subscribe(self._profile)
        if self.overlap_off_reason is None and self.policy.per_bucket:
            self._reads = ParameterReads(self.module, self._params, self._gating_modules())
        self.lifecycle = Lifecycle.WARMUP

    def _lay_out(self, forward_order: Sequence[int]) -> None:
        """Buckets, partitions and gates for ``effective_strategy``; gradients move into the new buckets."""
        strategy, transport = self.effective_strategy, self.transport
        self._remove_gates()
        if self.layout is not None:
            # Let go of the old buckets first: with the activations of a forward pass
            # alive, old and new buffers together would raise the peak memory by one
            # copy of every gradient. (Gradients still in them move bucket by bucket.)
            # The finished passes that held them are in reference cycles with their
            # completion callbacks: only a collection frees them (once per layout).
            self.layout = None
            self.policy.detach()
            gc.collect()
        layout = build_layout(
            self._names, self._params, forward_order, strategy.bucket_size_limits_bytes,
            transport.sums_usage_flags, lambda bucket_set: transport.attach(bucket_set, strategy.partition_bytes),
        )
        self.layout = layout
        self.plan = Plan(layout.partitions, tuple(fifo_plan(layout.partitions)), strategy.credit_bytes)
        self.policy.attach(layout)
        if self.overlap_off_reason is None:
            self._install_gates()
        self._events.layout_built(layout, transport.describe().placement)

    def _gating_modules(self) -> list[list[torch.nn.Module]]:
        return gating_modules(self.module, self._params, self._read_before_owner)

    def _install_gates(self) -> None:
        """One gate per module that waits for parameters, for the layout in use."""
        self._gates = ForwardGates(self._gating_modules(), self.layout.bucket_of, self._wait_for_buckets)

    def _remove_gates(self) -> None:
        if self._gates is not None:
            self._gates.remove()
            self._gates = None

    def _finish_warmup(self) -> tuple[int, ...] | None:
        """At the first iteration after warm-up: agree on the plan; overlap from now on, or not."""
        new_order = None
        profile = self._profile
        timeline: Timeline | None = None
        if profile is not None:
            started = time.perf_counter()
            strategy, group, control = self.strategy, self.process_group, self.control_group
            with self._peer_failures_explained():
                calibration = self._calibration or calibrate(self.layout, group, strategy.timeout_s, self.adapts)
                self._calibration = None
                if self.adapts:
                    self.choice, timeline = choose_on_rank0(self.layout, profile, calibration, strategy, control)
                    self._use_partitioning(self.choice.setting)
                self._warmup = WarmupTimeline.of(profile, calibration.latency_s, timeline.link if timeline else None)
                self.plan = self._agree_on_plan()
            self._events.unsubscribe(profile)
            self._profile = None
            new_order = self.plan.order
            logger.info("commsched: agreed on an order of %d partitions in %d buckets in %.1f ms",
                        len(new_order), len(self.layout.buckets), (time.perf_counter() - started) * 1e3)
        self.lifecycle = Lifecycle.after_warmup(self.overlap_off_reason)
        if self._reads is not None and self.lifecycle is Lifecycle.OVERLAPPING:
            self._use_recorded_reads(self._reads)
        if self.tuning is not None and self._warmup is not None:
            new_order = self._tuning_switch_point(WARMUP_ITERATIONS, timeline) or new_order
        return new_order

    def _calibrate_after(self, finished: BackwardPass) -> None:
        """At the end of warm-up's last profiled pass, its reductions complete: time the link
        for the plan (and the cost model), while memory is lowest (see `calibrate`). Collective:
        every rank ends that pass, a rank out of batches in `shadow_iteration`."""
        if self._profile is None or finished.iteration != WARMUP_ITERATIONS - 1:
            return
        with self._peer_failures_explained():
            self._calibration = calibrate(self.layout, self.process_group, self.strategy.timeout_s, self.adapts)

    def _agree_on_plan(self) -> Plan:
        """Rank 0's plan for the layout in use, from the warm-up's timeline (collective)."""
        warmup = self._warmup
        ready = bucket_ready_s(warmup.slot_ready_s, self.layout, self._held_buckets() or frozenset())
        return plan_on_rank0(self.layout.partitions, ready, warmup, self.effective_strategy.credit_bytes,
                             self.control_group, self.strategy.timeout_s)

    # ------------------------------------------------------------- auto-tuning
    def _tuning_switch_point(self, iteration: int, timeline: Timeline | None = None) -> tuple[int, ...] | None:
        """[Note: auto-tuning] Rank 0 decides, every rank applies: a new layout and plan, or none.

        Runs where `_use_partitioning` runs (the start of a synchronised pass,
        before its state exists), on every rank at the same iteration. Returns
        the new plan's order if the layout changed.
        """
        decision = self._decide(iteration, timeline) if dist.get_rank(self.control_group) == 0 else None
        with self._peer_failures_explained():
            decision = agree_on_decision(decision, self.control_group, self.strategy.timeout_s)
        self.tuning.apply(iteration, decision)
        strategy = self.strategy
        before = TunedSetting.of(self.effective_strategy).layout(strategy)
        overlap_before = self.overlap_off_reason
        self.effective_strategy = decision.setting.applied(strategy)
        if decision.setting.layout(strategy) == before and self.overlap_off_reason == overlap_before:
            return None
        self._lay_out(self.layout.forward_order)
        self._map_reads()
        with self._peer_failures_explained():
            self.plan = self._agree_on_plan()
        self.lifecycle = Lifecycle.after_warmup(self.overlap_off_reason)
        logger.info("commsched: %s from iteration %d on (%s): %d buckets, %d partitions", decision.setting.describe(),
                    iteration, self.tuning.describe(), len(self.layout.buckets), len(self.layout.partitions))
        return self.plan.order

    def _decide(self, iteration: int, timeline: Timeline | None) -> Decision:
        """Rank 0's decision; a failure of the tuner stops tuning, never training."""
        try:
            if self._controller is None:
                allowed = self.strategy.overlap_forward and self._overlap_blocked is None
                warmup = Warmup(self.strategy, timeline, None if self.choice is None else self.choice.setting,
                                allowed, tuple((p.numel(), p.element_size()) for p in self._params),
                                tuple(self.layout.forward_order), dist.get_world_size(self.process_group))
                start = starting_point(warmup)
                gradient_bytes = sum(p.numel() * p.element_size() for p in self._params)
                space = SearchSpace.around(gradient_bytes, start, allowed)
                self._controller = Controller(space, start, self.strategy, TuningConfig.of(self.strategy),
                                              simulated_guesses(warmup, space))
            return self._controller.decide(iteration)
        except Exception:  # noqa: BLE001 - tuning is an optimisation: keep training as it is
            logger.exception("commsched: auto-tuning stopped at iteration %d; the setting in use stays", iteration)
            if self._controller is not None:
                return self._controller.stop()
            return Decision(TuningPhase.STOPPED, TunedSetting.of(self.effective_strategy), 0)

    @property
    def adapts(self) -> bool:
        """Whether the cost model picks the partitioning; see `Strategy.adaptive`."""
        return self.strategy.cost_model_picks_partitioning

    def _use_partitioning(self, setting: Setting) -> None:
        """Lay the buckets out anew if the cost model chose another partitioning.

        Runs at the first gradient of the first iteration after warm-up, on every
        rank (the choice is rank 0's), before that pass's state exists: the
        reductions of the previous pass are complete and its updates applied, and
        the gradients accumulated so far move into the new buckets.
        """
        current = self.effective_strategy
        if (setting.partition_mb, setting.credit_mb) == (current.partition_mb, current.credit_mb):
            return
        self.effective_strategy = applied(self.strategy, setting)
        self._lay_out(self.layout.forward_order)
        logger.info("commsched: %d buckets, %d partitions from now on: %s", len(self.layout.buckets),
                    len(self.layout.partitions), self.choice.reason)

    def _held_buckets(self) -> frozenset[int] | None:
        """Buckets issued only at the end of backward; see [Note: nested backward passes]."""
        if self._repeated_slots is None:
            return None
        return frozenset(self.layout.bucket_of[slot] for slot in self._repeated_slots)

    def _use_recorded_reads(self, reads: ParameterReads) -> None:
        """[Note: reads outside the forward pass]: what warm-up saw decides what is updated early,
        and [Note: reads before the gate]: which parameters the root's gate waits for."""
        if reads.before_gate:
            self._gate_at_forward_start(list(reads.before_gate))
        self._read_slots = (frozenset(reads.before_forward), frozenset(reads.after_forward))
        self._map_reads()
        for slots, buckets, when in (
            (reads.before_forward, self.updated_at_step, "at step()"),
            (reads.after_forward, self.updated_after_forward, "when the forward pass returns"),
        ):
            if slots:
                logger.info(
                    "commsched: the training loop reads %d parameters (first: '%s') outside the forward pass; "
                    "their %d buckets are updated %s", len(slots), self._names[min(slots)], len(buckets), when,
                )
        if self.updated_after_forward:
            self._hooks.append(self.module.register_forward_hook(self._after_forward, always_call=True))

    def _gate_at_forward_start(self, slots: list[int]) -> None:
        for slot in slots:
            self._read_before_owner[slot] = self.module
        self.gated_at_forward_start = tuple(self._names[slot] for slot in slots)
        if self._gates is not None:
            self._remove_gates()
            self._install_gates()
        logger.warning(
            "commsched: a warm-up forward pass read %d parameters (first: '%s') before the modules that wait "
            "for them ran, unlike the first forward pass: with forward overlap, the forward pass now waits for "
            "their buckets at its start. If its paths can differ in other ways after warm-up, use "
            "Strategy(overlap_forward=False).", len(slots), self._names[slots[0]],
        )

    def _map_reads(self) -> None:
        """The buckets of the slots read outside the forward pass, in the layout in use."""
        if self._read_slots is None:
            return
        layout = self.layout
        before, after = self._read_slots
        self.updated_at_step = tuple(sorted({layout.bucket_of[s] for s in before}))
        self.updated_after_forward = tuple(sorted({layout.bucket_of[s] for s in after}))

    # ---------------------------------------------------------------- backward
    def _gradient_hook(self, slot: int) -> Callable[[torch.Tensor], None]:
        def on_gradient_accumulated(param: torch.Tensor) -> None:
            self._on_gradient_ready(slot, param)

        return on_gradient_accumulated

    def _on_gradient_ready(self, slot: int, param: torch.Tensor) -> None:
        """Hot path: once per parameter per backward pass."""
        if self._phase is Phase.IDLE:
            self._begin_backward()
        elif self._end_deferred:
            self._end_deferred = False
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        view = self.layout.views[slot]
        grad = param.grad
        if grad is not view:
            # None before this backward (zero_grad(set_to_none=True)) or replaced by the
            # user: move it into the bucket once.
            check_gradient_kind(self._names[slot], grad)
            view.copy_(grad)
            param.grad = view
        self._events.gradient_ready(slot)
        if self._phase is Phase.BACKWARD:
            self.current.gradient_ready(slot)

    def _begin_backward(self) -> None:
        synchronised = self._sync_enabled
        if synchronised:
            self.policy.before_backward(self.current is not None and not self.current.stepped)
        # The previous iteration's reductions write into the buffers we are about to fill.
        self.synchronize()
        if self.layout is None:
            self._build(list(range(len(self._params))), {})
        self._phase = Phase.BACKWARD if synchronised else Phase.ACCUMULATING
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if synchronised:
            self._begin_pass()

    def _begin_pass(self) -> None:
        """A new synchronised iteration: agree on the plan after warm-up, start a `BackwardPass`."""
        iteration = 0 if self.current is None else self.current.iteration + 1
        if self.current is not None:
            # Finished (synchronised): let go of it now, so that buckets laid out anew
            # below never coexist with the old ones, which it holds. Its operations are
            # dropped first: the pass and its dispatcher form a cycle, and operations
            # left in it would be freed by the garbage collector, perhaps only while the
            # interpreter finalizes (see [Note: process groups at exit]).
            self.previous_figures = self.current.figures
            self.current.drop_handles()
            self.current = None
        if self._controller is not None:
            self._controller.pass_started(iteration, time.perf_counter())
        new_order = None
        if iteration == WARMUP_ITERATIONS:
            new_order = self._finish_warmup()
        elif self._layout_may_change(iteration):
            new_order = self._tuning_switch_point(iteration)
        self.transport.begin_iteration(iteration, new_order)
        self.current = BackwardPass(
            iteration, self.layout, self.plan, self.transport, self.policy, self._events, self._tracker,
            self.strategy.timeout_s, overlapping=self.lifecycle is Lifecycle.OVERLAPPING,
            held_buckets=self._held_buckets(),
        )
        self.current.views_handed, self._views_handed = self._views_handed, frozenset()
        self._events.iteration_started(iteration)

    def _layout_may_change(self, iteration: int) -> bool:
        """Whether the pass of ``iteration`` may lay the buckets out anew (the end of warm-up, a tuning switch)."""
        return iteration == WARMUP_ITERATIONS or (self.tuning is not None and self.tuning.next_switch == iteration)

    def _end_backward(self) -> None:
        """Runs once the autograd engine has finished this backward pass."""
        if (
            self._phase is Phase.BACKWARD and not self.current.all_gradients_ready
            and inside_outer_backward()
        ):
            # [Note: nested backward] The outer pass may still produce gradients: its
            # next gradient queues this again, or the next use of the model ends the pass.
            self._end_deferred = True
            return
        self._end_deferred = False
        phase, self._phase = self._phase, Phase.IDLE
        if phase is not Phase.BACKWARD:
            return
        current = self.current
        current.end_backward()
        self._repeated_slots = frozenset(current.repeated_slots) | (self._repeated_slots or frozenset())
        if not current.overlapping:
            current.complete_all()
        self._events.backward_finished()
        self._calibrate_after(current)

    # ----------------------------------------------------------------- forward
    def _before_forward(self, module: torch.nn.Module, args: object) -> None:
        if running_backward():
            return  # [Note: recomputation]
        self._events.forward_started()
        self._end_deferred_backward()
        if self._phase is not Phase.IDLE:
            raise RuntimeError(BACKWARD_UNFINISHED)
        self._fingerprint.check()
        if self._sync_enabled and torch.is_grad_enabled():
            if self.join_enabled:
                # [Note: uneven inputs] Ranks that ran out of batches count this iteration.
                Join.notify_join_context(module)
            self._broadcast_buffers(training=True)
        if self.layout is None and torch.is_grad_enabled() and self._first_forward is None:
            self._first_forward = FirstForward(self.module, self._params, self._after_first_forward)

    def _after_forward(self, module: torch.nn.Module, args: object, output: object) -> None:
        """Buckets read after the forward pass (a module that did not run) are updated now."""
        current = self.current
        if current is not None and current.outstanding and not running_backward():
            current.complete_buckets(self.updated_after_forward)

    def _arm_views_ahead(self, module: torch.nn.Module, args: object, output: object) -> None:
        """The first output gradient of the coming backward pass hands out the bucket views."""
        if running_backward() or not torch.is_grad_enabled():
            return
        outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outputs:
            return
        armed = [True]

        def on_output_gradient(grad: torch.Tensor) -> None:
            if armed[0]:
                armed[0] = False
                self._hand_out_views()

        for tensor in outputs:
            tensor.register_hook(on_output_gradient)

    def _hand_out_views(self) -> None:
        """See [Note: views ahead of backward]. Runs in the backward pass, before any gradient hook."""
        if self._phase is not Phase.IDLE or not self._sync_enabled or self.layout is None:
            return
        current = self.current
        if self._layout_may_change(0 if current is None else current.iteration + 1):
            return  # gradients in the old buckets would keep them alive beside the new ones
        handed = hand_out_views(self.layout, (lambda bucket: True) if current is None else current.settled,
                                self._sparse_slots)
        if handed:
            self._views_handed = handed
            torch.autograd.Variable._execution_engine.queue_callback(self._take_back_unused_views)

    def _take_back_unused_views(self) -> None:
        """The backward pass is over: if it reached no parameter, no view handed out stays ``.grad``."""
        handed, self._views_handed = self._views_handed, frozenset()
        if handed and self._phase is Phase.IDLE:
            take_back(self.layout, handed)

    def _broadcast_buffers(self, training: bool) -> None:
        """Rank 0's buffers everywhere; under ``Join``, those of the highest rank still ``training``."""
        if not (self.strategy.broadcast_buffers and self.transport.world_size > 1):
            return
        # Looked up each time: a buffer may be replaced by a new tensor between iterations.
        buffers = [b for m in self._modules for b in m._buffers.values() if b is not None]
        if not buffers:
            return
        group, timeout_s = self.buffer_group, self.strategy.timeout_s
        if self.join_enabled:
            broadcast_from(buffers, highest_rank_still_training(training, group, timeout_s), group, timeout_s)
        else:
            broadcast_from_rank0(buffers, group, timeout_s)

    # ------------------------------------------------------------ uneven inputs
    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """Join's count of the ranks still training goes here: beside the gradients, not behind them."""
        return self.buffer_group

    @property
    def join_device(self) -> torch.device:
        if takes_cpu_tensors(self.join_process_group):
            return torch.device("cpu")
        return self._params[0].device

    @property
    def join_enabled(self) -> bool:
        config = getattr(self.module, "_join_config", None)
        return config is not None and config.enable

    def shadow_iteration(self) -> None:
        """[Note: uneven inputs] On a rank out of batches: one iteration of the others' collectives.

        The forward pass's buffer broadcast, then a backward pass with no
        gradient (zeros, flagged unused), issued in plan order and waited for;
        no update, as torch DDP's joined ranks do.
        """
        if self.layout is None:
            raise RuntimeError(
                "this rank ran out of batches before its first iteration, while the others train; "
                "commsched learns the bucket layout from the first iteration, so every rank needs at "
                "least one batch (drop_last=False with a DistributedSampler gives each rank one)"
            )
        self._broadcast_buffers(training=False)
        self.synchronize()
        self._phase = Phase.BACKWARD
        try:
            self._begin_pass()
            current = self.current
            current.end_backward(without_gradients=True)
            self._events.backward_finished()
            current.complete_all()
            self._calibrate_after(current)
        finally:
            self._phase = Phase.IDLE

    def _after_first_forward(self, order: list[int], read_before_owner: dict[int, torch.nn.Module]) -> None:
        self._first_forward = None
        with self._peer_failures_explained():
            order = agree_on_order(order, self.control_group, self.strategy.timeout_s)
        self._build(order, read_before_owner)

    def _wait_for_buckets(self, buckets: tuple[int, ...]) -> None:
        """A forward gate: this module's own buckets must be updated first."""
        current = self.current
        if current is not None and current.outstanding:
            current.complete_buckets(buckets)

    @contextmanager
    def _peer_failures_explained(self) -> Iterator[None]:
        """Let the transport name the lost rank when a collective among the replicas fails."""
        try:
            yield
        except CommunicationTimeout as error:
            self.transport.explain_failure(error)
            raise

    # -------------------------------------------------------------- public API
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _end_deferred_backward(self) -> None:
        """The model is used again, so a backward pass whose end was deferred is over."""
        if self._end_deferred:
            self._end_backward()

    def synchronize(self) -> None:
        """Block until every launched reduction is done, and every released update."""
        self._end_deferred_backward()
        if self._phase is not Phase.IDLE:
            raise synchronize_during_backward_error()
        current = self.current
        if current is not None:
            current.complete_all()
            # Gradients are final now: changing them before step() is legitimate.
            current.grads_final = True

    def step(self, optimizer_step: Callable[[], Any], scaling: GradScaling | None = None) -> None:
        """Release this iteration's updates (all at once without overlap).

        ``scaling``: what a ``GradScaler`` handed this step (see [Note: GradScaler]).
        """
        started = time.perf_counter()
        reads = self._reads
        if reads is not None:
            reads.stop()
        self._step(optimizer_step, scaling)
        if reads is not None:
            if self.lifecycle is Lifecycle.WARMUP:
                reads.start()
            elif not reads.active:
                self._reads = None
        self._events.step_finished(started, time.perf_counter())

    def _step(self, optimizer_step: Callable[[], Any], scaling: GradScaling | None) -> None:
        self._end_deferred_backward()
        current = self.current
        if self.lifecycle is Lifecycle.RELEASED:
            optimizer_step()
            return
        if current is not None and (current.stepped or current.grads_released):
            # [Note: a step without backward] No new reduced gradients since the last
            # step(), or zero_grad() dropped them: torch.optim steps on whatever .grad
            # holds now (nothing, for None), so the optimizer's own step does, once
            # this pass is finished.
            self.synchronize()
            self.policy.step_on_current_gradients(optimizer_step, again=current.stepped)
            current.stepped = True
            current.mark_updated()
            return
        if not self.policy.per_bucket:
            self.synchronize()
            optimizer_step()
            if current is not None:
                current.stepped = True
                current.mark_updated()
            return
        if current is None:
            return
        changed = current.gradients_changed()
        self.policy.check_step(changed, scaled=scaling is not None)
        if current.overlapping and not current.grads_final:
            if scaling is not None:
                raise grad_scaler_after_warmup_error()
            if changed:
                raise gradients_touched_error()
        current.stepped = True
        current.release_updates(self.policy.snapshot(), scaling)
        if current.overlapping and self.updated_at_step:
            current.complete_buckets(self.updated_at_step)
        if not current.overlapping:
            if self.lifecycle is Lifecycle.WARMUP and self.overlap_off_reason is None:
                reason = GRAD_SCALER_REASON if scaling is not None else GRADIENTS_CHANGED_REASON if changed else None
                if reason is not None:
                    self._overlap_blocked = reason
                    logger.warning("commsched: overlap_forward is off from now on: %s", reason)
            self.synchronize()

    def before_zero_grad(self, set_to_none: bool) -> None:
        self._end_deferred_backward()
        if not set_to_none:
            # Zeroing in place would race with reductions still in flight.
            self.synchronize()
        elif self.current is not None:
            # Gradients still being settled must not reappear as .grad afterwards.
            self.current.grads_released = True

    def before_optimizer_state_dict(self) -> None:
        self.synchronize()
        self.policy.fetch_optimizer_state()

    def after_optimizer_load(self) -> None:
        self.policy.push_optimizer_state()

    def after_module_load(self) -> None:
        self.policy.push_parameters()

    # ----------------------------------------------------------------- the end
    def close(self) -> None:
        """Finish what is in flight, let go of peers and hooks: the model trains locally afterwards."""
        from commsched.errors import communication_failed

        if self.lifecycle is Lifecycle.RELEASED:
            return
        if not communication_failed():  # else nothing in flight will finish: see shut_down
            self.synchronize()
        self.shut_down()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._remove_gates()
        if self._reads is not None:
            self._reads.stop()
            self._reads = None
        self.lifecycle = Lifecycle.RELEASED

    def shut_down(self) -> None:
        """Release peers, wait for callbacks, let go of the process groups, flush observers.

        Also what runs at exit for a model never released, without waiting for
        reductions (a failed run must still end).

        [Note: process groups at exit] The model, its hooks and this reducer form
        reference cycles, which the garbage collector breaks only while the
        interpreter finalizes. A process group that only this reducer still
        holds (its buffer group, or one the user destroyed) would be freed then:
        its destructor joins gloo's worker threads, which may still need the
        interpreter lock to drop a finished operation's tensors; a thread that
        asks for it during finalization is ended from inside a C++ destructor,
        and the process aborts ("terminate called without an active exception")
        after a clean run. So at exit, while every thread can still run, the
        reducer lets go of its groups and such a group is freed there.

        After a `CommunicationTimeout` in this process, nothing waits: callbacks
        still to come are dropped and the groups are abandoned, never freed
        (see [Note: exit after a failure] in commsched/errors.py).
        """
        from commsched.errors import abandon_process_groups, communication_failed

        if communication_failed():
            # A peer that is alive but out of step may still finish what is in flight:
            # its callbacks must run now, while the interpreter can run them, not during
            # its finalization (which aborts the process). A lost peer never finishes:
            # wait a moment only, then stop waiting.
            self._tracker.drain(timeout_s=FAILED_DRAIN_S)
            self._tracker.abandon()
            abandon_process_groups([self.process_group], abort=False)  # the caller's, or the job's default group
            # commsched's own, when it has them:
            abandon_process_groups([self.buffer_group, self.control_group], abort=True)
            forget_side_groups([self.buffer_group, self.control_group])
        self.transport.finish()
        self._tracker.drain()
        if self.current is not None:
            self.current.drop_handles()
        self.process_group = self.buffer_group = self.control_group = None  # type: ignore[assignment]
        self.transport.forget_process_groups()
        forget_destroyed()  # a destroyed group's side group is freed here, like the groups above
        self._events.closed()


def _at_exit(reducer_ref: weakref.ref) -> None:
    reducer = reducer_ref()
    if reducer is not None:
        reducer.shut_down()
