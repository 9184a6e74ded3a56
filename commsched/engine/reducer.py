"""The gradient reducer: one per prepared model, the coordinator of its engine.

Flow of one gradient (docs/architecture.md has the whole picture): its hook
(`commsched.engine.hooks`) -> `GradientReducer.gradient_ready` ->
`BackwardPass.gradient_ready` -> a complete bucket -> `Dispatcher` (plan
order, credit) -> `Transport.launch` -> `Handle` completes -> the pass
completes the bucket -> `UpdatePolicy.update` (at ``step()`` without overlap,
at the module's gate with it).

The reducer sequences one model's iterations: the `Lifecycle`, the current
`BackwardPass` and where the autograd pass is; and it answers the user's calls
(``step``, ``synchronize``, ``zero_grad``, ``no_sync``). Every other job is an
object it owns, each handed what it needs: the layout and plan in use and the
points where they change (`LayoutInUse`), the hooks, the forward gating,
forward overlap and an adopted optimizer (`ForwardOverlap`), the warm-up
(dropped when it is over), the buffer broadcast, Join's support, the
reduce-scatter decision and the shutdown.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join

from commsched.comm.transport import Transport
from commsched.device import HostSeam
from commsched.engine.backward_pass import BackwardPass, IterationFigures
from commsched.engine.buffers import BufferBroadcast
from commsched.engine.completion import CallbackTracker
from commsched.engine.config import RunConfig
from commsched.engine.events import EventBus, phase
from commsched.engine.finite import FiniteCheck, VerdictsToTell
from commsched.engine.gating import ForwardGating
from commsched.engine.groups import ProcessGroups
from commsched.engine.hooks import ModelHooks
from commsched.engine.join import ENDED_UNSTEPPED, STEP_WITHOUT_BACKWARD_UNDER_JOIN, JoinedSteps, UnevenInputs
from commsched.engine.layouts import LayoutInUse
from commsched.engine.lifecycle import WARMUP_ITERATIONS, Lifecycle, Phase
from commsched.engine.overlap import ForwardOverlap
from commsched.engine.scattering import ScatterDecision
from commsched.engine.shutdown import Shutdown
from commsched.engine.trace import Tracer
from commsched.engine.views_ahead import ViewsAhead
from commsched.engine.warmup import Warmup
from commsched.errors import CommunicationTimeout, communication_failed, failures_explained
from commsched.layout.compiled_gates import GatedRegions
from commsched.layout.gated_graphs import GatesInGraphs
from commsched.layout.grad_layout import GradLayout
from commsched.layout.partitions import Plan
from commsched.update.base import UpdatePolicy
from commsched.update.grad_scaling import GRAD_SCALER_REASON, GradScaling
from commsched.watch.autograd_context import inside_outer_backward
from commsched.watch.fingerprint import ParameterFingerprint
from commsched.watch.guards import (
    BACKWARD_UNFINISHED,
    GRADIENTS_CHANGED_REASON,
    check_gradient_kind,
    grad_scaler_after_warmup_error,
    gradients_touched_error,
    scattered_gradients_left_error,
    synchronize_during_backward_error,
)

logger = logging.getLogger("commsched")

class GradientReducer:
    """The current pass and the lifecycle of one prepared model, and the user's calls."""

    def __init__(
        self,
        module: torch.nn.Module,
        config: RunConfig,
        transport: Transport,
        policy: UpdatePolicy,
        groups: ProcessGroups,
        awaiting_optimizer: bool = False,
        seam: HostSeam | None = None,
    ):
        """``awaiting_optimizer``: no optimizer yet, one may be adopted at its first ``step()``
        (see [Note: an adopted optimizer] in `commsched.engine.overlap`); ``seam``: how waits order
        the gradients' device (see [Note: stream-ordered waits] in commsched/device.py)."""
        self.module, self.transport, self.policy, self.groups = module, transport, policy, groups
        self.seam = HostSeam() if seam is None else seam
        self._verdicts = VerdictsToTell()
        """`Strategy.check_finite`'s verdicts, told where they have reached the host."""
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.lifecycle = Lifecycle.RECORDING
        self.current: BackwardPass | None = None
        """The latest synchronised backward pass (its updates may still be pending)."""
        self.previous_figures: IterationFigures | None = None
        self._phase = Phase.IDLE
        self._end_deferred = False
        """The backward pass's end-of-pass callback ran in a nested backward pass
        before every gradient was in; see [Note: nested backward]."""
        self._sync_enabled = True
        self._scatter_decision = ScatterDecision(transport.scatter, lambda: groups.control, config.timeout_s)
        """Whether the loop lets gradients be reduce-scattered (see [Note: reduce-scattered buckets])."""
        self._views_ahead = ViewsAhead(module, self.params)
        self._fingerprint = ParameterFingerprint(module)
        self._events = EventBus()
        self._tracker = CallbackTracker()
        if config.trace_dir is not None:
            self._events.subscribe(
                Tracer(config.trace_dir, dist.get_rank(groups.replicas), module, self.params, self._tracker,
                       lambda: transport.completion_callbacks)
            )
        self.gating = ForwardGating(module, self.params, self.names, self.wait_for_buckets)
        self.overlap = ForwardOverlap(config.overlap_requested, policy, transport.is_local, awaiting_optimizer,
                                      self.gating.remove_gates)
        self.layouts = LayoutInUse(self.names, self.params, config, transport, policy, groups, self.gating,
                                   self.overlap, self._events)
        self.warmup: Warmup | None = Warmup(module, self.params, config, self._events, groups, transport, self._build,
                                            self.seam)
        """Until warm-up is over and the reads it watched are no longer watched."""
        self._backends: list[GatesInGraphs] = []
        self._regions = GatedRegions(module, self._gates_in_graphs) if config.overlap_requested else None
        """With forward overlap, the compiled regions, whose graphs wait for their buckets piece by piece."""
        self.hooks = ModelHooks(module, self.params, self)
        self.buffers = BufferBroadcast(lambda: self._fingerprint.modules, groups, config.timeout_s,
                                       config.broadcast_buffers and transport.world_size > 1, self.seam)
        self.uneven_inputs = UnevenInputs(module, groups, self.params[0], config.timeout_s,
                                          lambda: transport.join_refusal or policy.join_refusal,
                                          config.overlap_requested)
        self._joined_steps = JoinedSteps(None if policy.sharded is None else policy.sharded.step_records,
                                         self.uneven_inputs)
        self.shutdown = Shutdown(transport, self._tracker, self._events, groups, lambda: self.current,
                                 self._finish_in_flight, self.seam)
        if not config.priority:
            # Registration order reversed approximates the order gradients are produced.
            self._build(list(range(len(self.params))), {})

    def _gates_in_graphs(self, inner: Callable[..., Any]) -> GatesInGraphs:
        """The backend a compiled region compiles through while prepared, around its own (``inner``): one
        per backend alike (torch's backend wrappers compare equal on the same backend and options), so that
        regions of the same code (blocks compiled one by one) share their graphs, as they do unprepared."""
        backend = next((b for b in self._backends if b.inner == inner), None)
        if backend is None:
            slot_of = {id(param): slot for slot, param in enumerate(self.params)}
            backend = GatesInGraphs(inner, slot_of, self.gating.partitions_in_use, self.gating.wait_in_graph)
            self._backends.append(backend)
        return backend

    def check_untrained(self, what: str) -> None:
        """``what`` can change how gradients go on the wire only before any iteration."""
        if self.current is not None or self.lifecycle not in (Lifecycle.RECORDING, Lifecycle.WARMUP):
            raise RuntimeError(
                f"{what} must be called before the first forward pass (as torch DDP requires it before the "
                "first backward): this model has trained already. Call it right after wrapping the model.")

    def rewire(self, change_transport: Callable[[], None]) -> None:
        """Before any training (a comm hook registered on the drop-in): ``change_transport()`` changes
        what goes on the wire, and the layout is made anew, as if the model had been prepared so."""
        self.check_untrained("register_comm_hook()")
        change_transport()
        self.layouts.rebuild()

    # ---------------------------------------------------------------- state
    @property
    def overlap_off_reason(self) -> str | None:
        """Why forward overlap is (or will be) off; None while it is on or still possible."""
        return self.layouts.overlap_off_reason

    @property
    def compiled_pieces(self) -> tuple[int, ...]:
        """Per graph compiled through the gating backends, its pieces."""
        return tuple(n for backend in self._backends for n in backend.pieces)

    @property
    def awaiting_optimizer(self) -> bool:
        """No optimizer yet: one may be adopted at its first ``step()`` during warm-up."""
        return self.overlap.awaiting_optimizer

    @property
    def config(self) -> RunConfig:
        """The `Strategy` resolved once; its layout setting is the one in use."""
        return self.layouts.config

    @property
    def layout(self) -> GradLayout | None:
        return self.layouts.layout

    @property
    def plan(self) -> Plan | None:
        return self.layouts.plan

    @property
    def reduce_scatter_off_reason(self) -> str | None:
        """Why gradients stay all-reduced though the strategy asks for a reduce-scatter; None otherwise."""
        return self._scatter_decision.off_reason(warming_up=self.lifecycle is Lifecycle.WARMUP)

    def _build(self, forward_order: list[int], read_before_owner: dict[int, torch.nn.Module]) -> None:
        """The first layout, once the forward order is known; warm-up starts."""
        overlap_possible = self.layouts.first(forward_order, read_before_owner)
        self.warmup.layout_built(self.gating.modules() if overlap_possible else None)
        self.lifecycle = Lifecycle.WARMUP

    def _finish_warmup(self) -> tuple[int, ...] | None:
        """At the first iteration after warm-up: the choice, the plan, overlap or not, tuning
        (`LayoutInUse.after_warmup`). Returns the new plan's order if there is one."""
        if self.overlap.awaiting_optimizer:
            self.overlap.optimizer_settled()  # none was adopted: train as prepared without one
        result = self.warmup.finish(self.layout)
        new_order = self.layouts.after_warmup(result, scattering=self._scatter_decision.start())
        self.lifecycle = Lifecycle.after_warmup(self.overlap_off_reason)
        return new_order

    def _tuning_switch_point(self, iteration: int) -> tuple[int, ...] | None:
        new_order = self.layouts.switch_point(iteration)
        if new_order is not None:
            self.lifecycle = Lifecycle.after_warmup(self.overlap_off_reason)
        return new_order

    # ---------------------------------------------------------------- backward
    def gradient_ready(self, slot: int, param: torch.Tensor) -> None:
        """Hot path: once per parameter per backward pass."""
        if self._phase is Phase.IDLE:
            self._begin_backward()
        elif self._end_deferred:
            self._end_deferred = False
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        view = self.layouts.layout.views[slot]  # hot path: the attribute, not the property
        grad = param.grad
        if grad is not view:
            # None before this backward (zero_grad(set_to_none=True)) or replaced by the
            # user: move it into the bucket once.
            check_gradient_kind(self.names[slot], grad)
            view.copy_(grad)
            param.grad = view
        if self._events.observed:
            self._events.gradient_ready(slot)
        if self._phase is Phase.BACKWARD:
            self.current.gradient_ready(slot)

    def _begin_backward(self) -> None:
        synchronised = self._sync_enabled
        if synchronised:
            self.policy.before_backward(self.current is not None and not self.current.stepped)
        # The previous iteration's reductions write into the buffers we are about to fill.
        self._complete_pass()
        if self.current is not None and self.current.gradients_left_scattered():
            raise scattered_gradients_left_error()
        self._report_nonfinite(self.current)
        if self.layout is None:
            self._build(list(range(len(self.params))), {})
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
        if self.layouts.tuning is not None:
            self.layouts.tuning.pass_started(iteration, time.perf_counter())
        new_order = None
        if iteration == WARMUP_ITERATIONS:
            with phase("commsched::warmup"):
                new_order = self._finish_warmup()
        elif self.layouts.may_change(iteration):
            new_order = self._tuning_switch_point(iteration)
        self.transport.begin_iteration(iteration, new_order)
        finite_check = None
        if self.config.check_finite is not None:
            finite_check = FiniteCheck(self.config.check_finite, dist.get_rank(self.groups.replicas),
                                       self.transport.world_size, iteration)
        self.current = BackwardPass(
            iteration, self.layout, self.plan, self.transport, self.policy, self._events, self._tracker,
            self.config.timeout_s, overlapping=self.lifecycle is Lifecycle.OVERLAPPING,
            held_buckets=self.layouts.held_buckets(), finite_check=finite_check, seam=self.seam,
        )
        self.current.views_handed = self._views_ahead.taken()
        if self._events.observed:
            self._events.iteration_started(iteration)

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
        ended, self._phase = self._phase, Phase.IDLE
        if ended is not Phase.BACKWARD:
            return
        current = self.current
        current.end_backward()
        layouts = self.layouts  # held to the end of backward from now on: [Note: nested backward passes]
        layouts.repeated_slots = frozenset(current.repeated_slots) | (layouts.repeated_slots or frozenset())
        if not current.overlapping:
            current.complete_all()
        if self._events.observed:
            self._events.backward_finished()
        if self.warmup is not None:
            self.warmup.pass_ended(current, self.layout)

    def backward_starting(self) -> None:
        """[Note: views ahead of backward] Runs in the backward pass, before any gradient hook."""
        if self._phase is not Phase.IDLE or not self._sync_enabled or self.layout is None:
            return
        current = self.current
        if self.layouts.may_change(0 if current is None else current.iteration + 1):
            return  # gradients in the old buckets would keep them alive beside the new ones
        self._views_ahead.hand_out(self.layout, (lambda bucket: True) if current is None else current.settled,
                                   lambda: self._phase is Phase.IDLE)

    def shadow_iteration(self) -> None:
        """[Note: uneven inputs] On a rank out of batches: one iteration of the others' collectives.

        The forward pass's buffer broadcast, then a backward pass with no
        gradient (zeros, flagged unused), issued in plan order and waited for;
        no update, as torch DDP's joined ranks do, except of this rank's chunks
        of sharded state (see [Note: a joined rank's shard]).
        """
        if self.layout is None:
            raise RuntimeError(
                "this rank ran out of batches before its first iteration, while the others train; "
                "commsched learns the bucket layout from the first iteration, so every rank needs at "
                "least one batch (drop_last=False with a DistributedSampler gives each rank one)"
            )
        try:
            with failures_explained(self.transport.explain_failure):
                self._joined_steps.shadowing()
                self._shadow_collectives()
        except CommunicationTimeout as error:
            if not self._joined_steps.ended_unstepped:
                raise
            # [Note: waking the last trainer] in `commsched.engine.join`
            raise CommunicationTimeout(f"{error} {ENDED_UNSTEPPED}.") from error

    def _shadow_collectives(self) -> None:
        self.buffers.shadow_iteration(under_join=self.uneven_inputs.enabled)
        self.synchronize()
        self._phase = Phase.BACKWARD
        try:
            self._begin_pass()
            current = self.current
            current.end_backward(without_gradients=True)
            if self._events.observed:
                self._events.backward_finished()
            current.complete_all()
            if self.warmup is not None:
                self.warmup.pass_ended(current, self.layout)
        finally:
            self._phase = Phase.IDLE
        if self._joined_steps.needed:
            # [Note: a joined rank's shard] This rank's chunks take the others' step.
            step = self._joined_steps.receive(self.policy.snapshot())
            if step is not None:
                current.release_updates(*step)
                current.start_updates()

    # ----------------------------------------------------------------- forward
    def before_forward(self) -> None:
        if self._events.observed:
            self._events.forward_started()
        self._end_deferred_backward()
        if self._phase is not Phase.IDLE:
            raise RuntimeError(BACKWARD_UNFINISHED)
        self._fingerprint.check()
        if torch.is_grad_enabled():
            under_join = self.uneven_inputs.enabled
            if under_join and self._sync_enabled:
                # [Note: uneven inputs] Ranks that ran out of batches count this iteration.
                self._joined_steps.count(lambda: Join.notify_join_context(self.module))
            self.buffers.before_forward(self._sync_enabled, under_join)
        if self.layout is None and torch.is_grad_enabled():
            self.warmup.record_first_forward()

    def wait_for_buckets(self, buckets: Sequence[int]) -> None:
        """A forward gate: this module's own buckets must be updated first."""
        current = self.current
        if self.seam.orders_streams:
            self.seam.check()  # a collective ordered long ago and still running: a stalled peer
        if current is not None and current.outstanding:
            with failures_explained(self.transport.explain_failure):  # sharded state's all-gathers too
                current.complete_buckets(buckets)

    # ------------------------------------------------------------ user's calls
    @property
    def sync_enabled(self) -> bool:
        """Whether the next backward pass reduces gradients (False: they accumulate locally)."""
        return self._sync_enabled

    @sync_enabled.setter
    def sync_enabled(self, enabled: bool) -> None:
        self._sync_enabled = bool(enabled)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    # --------------------------------------------------- an adopted optimizer
    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        """Take ``optimizer`` as the one given to prepare(), at its first ``step()``, before
        torch.optim's own step runs; returns what must run once that step is done
        ([Note: an adopted optimizer] in `commsched.engine.overlap`)."""
        self.overlap.awaiting_optimizer = False
        finished = self._step_starts()
        self._step(lambda: None, None)  # this pass is stepped: torch.optim's own step follows
        self.policy.adopt(optimizer, self.layout)
        self.overlap.optimizer_settled()
        return finished

    def decline_optimizer(self, reason: str) -> None:
        """An optimizer this model would adopt steps other models' parameters too: it is not
        adopted, and it steps as torch.optim does, once every gradient is averaged (``reason``:
        why forward overlap is off)."""
        self.overlap.optimizer_declined(reason)

    def _end_deferred_backward(self) -> None:
        """The model is used again, so a backward pass whose end was deferred is over."""
        if self._end_deferred:
            self._end_backward()

    def _complete_pass(self) -> None:
        """Every launched reduction and released update is done: on the CPU the host waits; on a
        GPU they are ordered before whatever the stream runs next (see [Note: stream-ordered
        waits] in commsched/device.py)."""
        self._end_deferred_backward()
        if self._phase is not Phase.IDLE:
            raise synchronize_during_backward_error()
        current = self.current
        if current is not None:
            with failures_explained(self.transport.explain_failure):  # sharded state's all-gathers too
                current.complete_all()
            current.synchronized()  # gradients are final: changing them before step() is legitimate

    def synchronize(self) -> None:
        """Block until every launched reduction is done, and every released update, on the host too:
        for what reads results there (state dicts, copies, release)."""
        self._complete_pass()
        with failures_explained(self.transport.explain_failure):
            self.seam.wait_all(self.config.timeout_s)

    def synchronize_for_user(self) -> None:
        """``optimizer.synchronize()``: as `synchronize`, and noted on the pass; on a GPU the stream
        is ordered after the reductions and the host goes on, as after torch DDP's backward pass
        (a loop that clips gradients calls it every iteration). A loop that calls it before
        changing gradients in place (clipping) keeps forward overlap, since it will call it every
        time; another optimizer may step after it (see [Note: foreign optimizers])."""
        self._complete_pass()
        if self.current is not None:
            self.current.synchronized(by_user=True)

    def _report_nonfinite(self, latest: BackwardPass | None) -> None:
        """With `Strategy.check_finite`: tell what ``latest`` and earlier passes found, as far as it
        has reached the host (on a GPU the host does not wait for it)."""
        self._verdicts.tell(None if latest is None else latest.nonfinite_verdict(), not self.seam.orders_streams)

    def state_loaded(self) -> None:
        """``load_state_dict()`` changed the parameters: with parameter servers, they get the new values."""
        if self.policy.state_elsewhere is not None:
            self.policy.state_elsewhere.push_parameters()

    def step(self, optimizer_step: Callable[[], Any], scaling: GradScaling | None = None) -> None:
        """Release this iteration's updates (all at once without overlap).

        ``scaling``: what a ``GradScaler`` handed this step (see [Note: GradScaler]).
        """
        if scaling is not None and self.transport.compression is not None:
            raise ValueError(
                "a torch.amp.GradScaler steps this optimizer, but with Strategy(compression=...) a step it skips "
                "for inf or NaN gradients would leave them in the compression's error feedback, and every later "
                "step would skip too. Train with bf16 autocast, which needs no GradScaler, or without compression.")
        finished = self._step_starts()
        with failures_explained(self.transport.explain_failure), phase("commsched::step"):
            self._step(optimizer_step, scaling)
        finished()

    def _step_starts(self) -> Callable[[], None]:
        """What surrounds a step's own work: warm-up hears of it before and after, the events get its time.
        Returns what runs once the step is done."""
        warmup, started = self.warmup, time.perf_counter()
        if warmup is not None:
            warmup.before_step()

        def finished() -> None:
            if warmup is not None and warmup.after_step(warming_up=self.lifecycle is Lifecycle.WARMUP):
                self.warmup = None
            if self._events.observed:
                self._events.step_finished(started, time.perf_counter())

        return finished

    def _step(self, optimizer_step: Callable[[], Any], scaling: GradScaling | None) -> None:
        """One of four steps: after release, without new gradients, whole, or per bucket."""
        self._end_deferred_backward()
        current = self.current
        if self.lifecycle is Lifecycle.RELEASED:
            optimizer_step()
        elif current is not None and not current.has_new_gradients:
            self._step_without_backward(current, optimizer_step, scaling)
        elif not self.policy.per_bucket:
            self._step_whole(current, optimizer_step, scaling)
        elif current is not None:
            self._step_per_bucket(current, scaling)

    def _step_without_backward(self, current: BackwardPass, optimizer_step: Callable[[], Any],
                               scaling: GradScaling | None) -> None:
        """[Note: a step without backward] No new reduced gradients since the last step(), or
        zero_grad() dropped them: torch.optim steps on whatever .grad holds now (nothing, for
        None), so the optimizer's own step does, once this pass is finished."""
        if self._joined_steps.needed and self.uneven_inputs.enabled:
            raise RuntimeError(STEP_WITHOUT_BACKWARD_UNDER_JOIN)
        self._complete_pass()
        if not (self.config.check_finite and scaling is None and current.gradients_hold_nonfinite()):
            self.policy.step_on_current_gradients(optimizer_step, again=current.stepped)
        current.stepped_whole()

    def _step_whole(self, current: BackwardPass | None, optimizer_step: Callable[[], Any],
                    scaling: GradScaling | None) -> None:
        """A policy without per-bucket updates: torch.optim's step, on every gradient averaged."""
        if current is not None:
            current.scaled_by(scaling)
        self._complete_pass()
        if current is None or not current.skipped_as_nonfinite:
            optimizer_step()
        if current is not None:
            current.stepped_whole()
            self._report_nonfinite(current)

    def _step_per_bucket(self, current: BackwardPass, scaling: GradScaling | None) -> None:
        """Check the step can be right, then release the pass's updates with this moment's
        hyper-parameters: at once without overlap, at the gates with it."""
        changed = current.gradients_changed()
        self.policy.check_step(changed, scaled=scaling is not None)
        warming_up = self.lifecycle is Lifecycle.WARMUP
        self._scatter_decision.stepped(changed, scaled=scaling is not None, warming_up=warming_up)
        if current.overlapping and not current.gradients_may_change:
            if scaling is not None:
                raise grad_scaler_after_warmup_error()
            if changed:
                raise gradients_touched_error()
        hyperparameters = self.policy.snapshot()
        self._joined_steps.stepped(hyperparameters, scaling)
        current.release_updates(hyperparameters, scaling)
        if current.overlapping and self.gating.updated_at_step:
            current.complete_buckets(self.gating.updated_at_step)
        if not current.overlapping:
            if warming_up and self.overlap_off_reason is None:
                changed_unsynchronized = changed and not current.synchronized_by_user
                reason = (GRAD_SCALER_REASON if scaling is not None
                          else GRADIENTS_CHANGED_REASON if changed_unsynchronized else None)
                if reason is not None:
                    self.overlap.block(reason)
            self._complete_pass()
            self._report_nonfinite(current)

    def before_zero_grad(self, set_to_none: bool) -> None:
        self._end_deferred_backward()
        if not set_to_none:
            # Zeroing in place would race with reductions still in flight (on a GPU: is queued after them).
            self._complete_pass()
        if self.current is not None:
            # Set to None, gradients still being settled must not reappear as .grad afterwards.
            self.current.zero_grad(set_to_none)

    def _finish_in_flight(self) -> None:
        """At exit, for a model never released: see [Note: operations in flight at exit] in
        `commsched.engine.shutdown`. Its updates run too where the pass is over. Never raises: a
        failure here is a `CommunicationTimeout` noted, after which the shutdown waits for nothing."""
        current = self.current
        if current is None or self.lifecycle is Lifecycle.RELEASED:
            return
        try:
            if self._phase is Phase.IDLE:
                self.synchronize()
            else:  # the script ended inside a backward pass
                current.wait_in_flight()
        except Exception:  # noqa: BLE001 - the process is ending: say what happened and let it end
            logger.warning("commsched: what was in flight at exit did not finish", exc_info=True)

    def close(self) -> None:
        """Finish what is in flight, let go of peers and hooks: the model trains locally afterwards."""
        if self.lifecycle is Lifecycle.RELEASED:
            return
        if not communication_failed():  # else nothing in flight will finish: see `Shutdown`
            self.synchronize()
            self._joined_steps.close()
            self.policy.close()
        self.shutdown()
        self.hooks.remove()
        self.gating.close()
        if self._regions is not None:
            self._regions.restore()
        if self.warmup is not None:
            self.warmup.close()
            self.warmup = None
        self.lifecycle = Lifecycle.RELEASED
