"""The gradient reducer: from "a gradient is ready" to "the parameter is updated".

One `GradientReducer` is attached to each prepared model. Per backward pass:

1. a post-accumulate-grad hook marks a parameter ready (its gradient already
   sits in its bucket's flat buffer, since ``param.grad`` is a view into it);
2. a complete bucket is divided by the world size and its partitions are handed
   to the `PlanExecutor`, which issues them in the agreed order under the
   credit window (see `commsched.scheduler`);
3. at the end of the backward pass (an autograd engine callback) parameters
   that got no gradient are resolved and everything left is issued.

Then, without forward overlap, the end of backward waits for every reduction
(torch DDP's behaviour: code between ``backward()`` and ``step()`` sees averaged
gradients) and ``step()`` updates. With forward overlap, ``backward()`` and
``step()`` return at once, and each module's forward pre-hook (its *gate*)
waits for its own buckets' reductions and runs their update.

[Note: unused parameters] A parameter may get no gradient in an iteration on
some ranks or on all. Each rank writes, per parameter, whether it holds a
gradient into a few extra elements at the end of the *flags bucket* (the one
the next forward needs first, whose gradients are ready last anyway); it is
issued only at the end of the backward pass, when every flag is known. The sum
over ranks tells every rank which parameters no rank used: those keep
``grad=None`` and are not updated, exactly as in single-process training. No
extra collective, and no ``find_unused_parameters`` switch.

[Note: gradients the user touches] With forward overlap, reductions may still
be in flight when ``backward()`` returns, so a gradient changed in place before
``step()`` (clipping, AMP unscaling) would race with them. The first
`WARMUP_ITERATIONS` run without overlap and watch the version counters of the
gradient buffers: a loop that changes gradients keeps running without overlap
(logged once). A change seen later, with reductions in flight, stops training
with an error that says what to do.
"""

from __future__ import annotations

import atexit
import enum
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from commsched.backends.base import Backend, CommunicationTimeout, Handle
from commsched.buckets import Bucket, bucket_layout
from commsched.consistency import broadcast_from_rank0
from commsched.order import ForwardRecorder, agree_on_order
from commsched.planning import ReadyTimeProfile, plan_on_rank0
from commsched.scheduler import Partition, PlanExecutor, fifo_plan, make_partitions
from commsched.strategy import Strategy
from commsched.trace import Tracer, now_us
from commsched.updates import BucketUpdater, unsupported_reason

logger = logging.getLogger("commsched")

WARMUP_ITERATIONS = 3
"""Iterations run without forward overlap while watching for gradient changes. All
but the first (slow) one are profiled, and the plan is made when they end."""
PLAN_ITERATION = WARMUP_ITERATIONS


class Phase(enum.Enum):
    IDLE = "idle"
    """No backward pass running."""
    BACKWARD = "backward"
    """A backward pass is producing gradients and issuing partitions."""


class GradientReducer:
    """Buckets, hooks, in-flight reductions and gates of one prepared model."""

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        strategy: Strategy,
        backend: Backend,
        process_group: dist.ProcessGroup,
        buffer_group: dist.ProcessGroup | None = None,
    ):
        self.module = module
        self.optimizer = optimizer
        self.strategy = strategy
        self.backend = backend
        self.process_group = process_group
        self.buffer_group = buffer_group or process_group
        self.world_size = backend.world_size
        self.phase = Phase.IDLE

        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._num_slots = len(self._params)

        self.updater: BucketUpdater | None = None
        self._overlap_off_reason: str | None = None
        if optimizer is not None and (strategy.fuse_optimizer or strategy.overlap_forward):
            self._overlap_off_reason = unsupported_reason(optimizer)
        elif strategy.overlap_forward:
            self._overlap_off_reason = "no optimizer was given to prepare()"
        if strategy.overlap_forward and self._overlap_off_reason:
            logger.warning("commsched: overlap_forward is off: %s", self._overlap_off_reason)

        # Built once the parameter order is known (see _build).
        self.buckets: list[Bucket] = []
        self.partitions: list[Partition] = []
        self._executor: PlanExecutor | None = None
        self._views: list[torch.Tensor] = []
        self._bucket_of: list[int] = []
        self._flags_bucket = -1
        self._gate_buckets: dict[int, list[int]] = {}
        self._root_gate_buckets: list[int] = []
        self._recorder: ForwardRecorder | None = None
        self._profile: ReadyTimeProfile | None = None
        self._profiling = False

        # Per backward pass / iteration.
        self._sync_enabled = True
        self._sync_this_backward = True
        self._iteration = -1
        self._ready: list[bool] = []
        self._has_grad: list[bool] = [False] * self._num_slots
        self._pending: list[int] = []
        self._unowned_grad_slots: list[int] = []
        self._globally_unused: frozenset[int] = frozenset()
        self._flags_settled = True
        self._handles: list[list[Handle]] = []
        self._reduced: list[bool] = []
        self._updated: list[bool] = []
        self._launch_version: list[int] = []
        self._outstanding = 0
        self._overlap_now = False
        self._step_hyperparameters: list[dict] | None = None
        self._user_may_touch_grads = False
        self._grads_released = False
        self._stepped = False

        # Partitions are issued by the main thread (gradient hooks) and, when credit
        # comes back, by communication threads: one at a time, in plan order.
        self._issue_lock = threading.Lock()
        self._issuing_thread: int | None = None
        self._callbacks_done = threading.Condition()
        self._callbacks_pending = 0
        self._issue_error: Exception | None = None
        self._tracer: Tracer | None = None
        self._ready_us: list[float] = []
        if strategy.trace_dir is not None:
            self._tracer = Tracer(strategy.trace_dir, dist.get_rank(process_group))
            atexit.register(self._tracer.write)
        atexit.register(_at_exit, weakref.ref(self))  # runs before the trace is written

        self._modules = list(module.modules())
        self._fingerprint = self._take_fingerprint()
        self._snapshot = self._describe_parameters()
        self._hook_handles: list[RemovableHandle] = [
            param.register_post_accumulate_grad_hook(self._make_grad_hook(slot))
            for slot, param in enumerate(self._params)
        ]
        self._hook_handles.append(module.register_forward_pre_hook(self._before_forward))
        if self._tracer is not None:
            self._hook_handles += self._tracer.attach_modules(module, self._params)
        if not strategy.priority:
            # Registration order reversed approximates the order gradients are produced.
            self._build(list(range(self._num_slots)))

    # ------------------------------------------------------------------ build
    @property
    def overlap_enabled(self) -> bool:
        return self.strategy.overlap_forward and self._overlap_off_reason is None

    def _build(self, forward_order: list[int], used_before_owner: set[int] = frozenset()) -> None:
        """Buckets in reverse forward order, their partitions, the plan and the gates."""
        bucket_slots, priorities = bucket_layout(self._params, forward_order, self.strategy.bucket_size_limits_bytes)
        # The flags bucket holds the first parameter of the forward pass.
        self._flags_bucket = next(b for b, slots in enumerate(bucket_slots) if forward_order[0] in slots)
        flags_numel = 0 if self.backend.server_side_update else self._num_slots
        self.buckets = [
            Bucket(b, [self._params[s] for s in slots],
                   tail_numel=flags_numel if b == self._flags_bucket else 0)
            for b, slots in enumerate(bucket_slots)
        ]
        self._views = [torch.empty(0)] * self._num_slots
        self._bucket_of = [0] * self._num_slots
        for bucket, slots in zip(self.buckets, bucket_slots):
            for slot, view in zip(slots, bucket.grad_views):
                self._views[slot] = view
                self._bucket_of[slot] = bucket.index
                grad = self._params[slot].grad
                if grad is not None:  # gradients from before the build move into the bucket
                    view.copy_(grad)
                    self._params[slot].grad = view
        self._bucket_param_counts = [len(s) for s in bucket_slots]

        self.partitions = self.backend.prepare_buckets(
            forward_order, bucket_slots, priorities, self.buckets, self._has_grad
        ) or make_partitions(
            [b.flat.numel() for b in self.buckets],
            [b.flat.element_size() for b in self.buckets],
            priorities,
            self.strategy.partition_bytes,
        )
        self._executor = PlanExecutor(self.partitions, fifo_plan(self.partitions), self.strategy.credit_bytes)
        layout = self.backend.layout_summary()
        if layout is not None and self._tracer is not None:
            self._tracer.note("layout", summary=layout)
        if self.strategy.priority:
            self._profile = ReadyTimeProfile(len(self.buckets))

        wants_updater = self.strategy.fuse_optimizer or self.strategy.overlap_forward
        if self.backend.server_side_update:
            self.updater = self.backend.make_updater()
        elif self.optimizer is not None and wants_updater and self._overlap_off_reason is None:
            self.updater = BucketUpdater(
                self.optimizer,
                [b.params for b in self.buckets],
                [b.grad_views for b in self.buckets],
                bucket_slots,
                fused=self.strategy.fuse_optimizer,
            )
        if self.overlap_enabled:
            self._install_gates(used_before_owner)
        self._reset_iteration_state()

    def _install_gates(self, used_before_owner: set[int]) -> None:
        slot_of = {id(p): s for s, p in enumerate(self._params)}
        for module in self._modules:
            slots = {slot_of[id(p)] for p in module._parameters.values() if p is not None and id(p) in slot_of}
            if slots and module is not self.module:
                self._gate_buckets[id(module)] = sorted({self._bucket_of[s] for s in slots})
                self._hook_handles.append(module.register_forward_pre_hook(self._gate))
            elif slots:
                used_before_owner = set(used_before_owner) | slots
        self._root_gate_buckets = sorted({self._bucket_of[s] for s in used_before_owner})

    def _reset_iteration_state(self) -> None:
        n = len(self.buckets)
        self._ready_us = [0.0] * n
        self._handles = [[] for _ in range(n)]
        self._reduced = [True] * n
        self._updated = [True] * n
        self._launch_version = [0] * n
        self._outstanding = 0

    def _make_grad_hook(self, slot: int):
        def on_grad_accumulated(param: torch.Tensor) -> None:
            self._on_grad_ready(slot, param)

        return on_grad_accumulated

    def close(self) -> None:
        """Remove every hook; the model trains as a plain local module afterwards."""
        self.synchronize()
        self.drain_callbacks()
        self.backend.finish()
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        if self._tracer is not None:
            self._tracer.write()

    def finish_at_exit(self) -> None:
        """Release peers, wait for callbacks, and let go of the process groups.

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
        """
        self.backend.finish()
        self.drain_callbacks()
        self._handles = [[] for _ in self._handles]
        self.process_group = self.buffer_group = None  # type: ignore[assignment]
        self.backend.forget_process_groups()

    # ------------------------------------------------------------- public API
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def synchronize(self) -> None:
        """Block until every launched reduction is done, and every released update."""
        if self.phase is Phase.BACKWARD:
            raise RuntimeError(
                "synchronize() was called during a backward pass; call it after backward() returns"
            )
        for bucket in range(len(self.buckets)):
            self._complete_bucket(bucket)
        # Gradients are final now: changing them before step() is legitimate.
        self._user_may_touch_grads = True

    def step(self, step_with_optimizer) -> None:
        """Release this iteration's updates (all at once without overlap)."""
        if self._tracer is None:
            self._step(step_with_optimizer)
            return
        started = now_us()
        self._step(step_with_optimizer)
        self._tracer.span("compute", "step", started, now_us())

    def _step(self, step_with_optimizer) -> None:
        if self._step_hyperparameters is not None:
            # A second step() on the same gradients: finish the first, then redo it whole.
            self.synchronize()
            self._step_hyperparameters = None
            self._updated = [False] * len(self.buckets)
            self._outstanding = len(self.buckets)
        if self.backend.server_side_update:
            self._check_server_side_step()
        elif self._overlap_now:
            self._check_gradients_untouched()
        if self.updater is None:
            self.synchronize()
            step_with_optimizer()
            self._updated = [True] * len(self.buckets)
            self._outstanding = 0
            return
        self._step_hyperparameters = self.updater.snapshot()
        if not self._overlap_now:
            self._note_gradient_changes_before_overlap()
            self.synchronize()

    def _check_server_side_step(self) -> None:
        """The servers updated with the gradients and hyper-parameters of backward() time."""
        if self._iteration >= 0 and self._gradient_versions_changed():
            raise RuntimeError(
                "gradients were modified between backward() and step(), but with "
                "Strategy(backend='ps') they were pushed to the servers during backward() and the "
                "servers run the optimizer, so the change would be ignored. Gradient clipping and "
                "AMP unscaling need the averaged gradients on the workers: use "
                "Strategy(backend='allreduce') for them."
            )
        self.backend.check_hyperparameters_unchanged()
        self._stepped = True

    def before_optimizer_state_dict(self) -> None:
        self.synchronize()
        self.backend.fetch_optimizer_state()

    def after_optimizer_load(self) -> None:
        self.backend.push_optimizer_state()

    def after_module_load(self) -> None:
        self.backend.push_parameters()

    def before_zero_grad(self, set_to_none: bool) -> None:
        if set_to_none:
            # Gradients still being settled must not reappear as .grad afterwards.
            self._grads_released = True
        else:
            # Zeroing in place would race with reductions still in flight.
            self.synchronize()

    # ------------------------------------------------------------ hot path
    def _on_grad_ready(self, slot: int, param: torch.Tensor) -> None:
        if self.phase is not Phase.BACKWARD:
            self._begin_backward()
        view = self._views[slot]
        grad = param.grad
        if grad is not view:
            # The gradient was None before this backward (zero_grad(set_to_none=True))
            # or replaced by the user: move it into the bucket once.
            self._check_gradient_kind(slot, grad)
            view.copy_(grad)
            param.grad = view
        self._ready[slot] = True
        if self._tracer is not None:
            self._tracer.param_ready(slot)
        if not self._sync_this_backward:
            return
        self._has_grad[slot] = True
        bucket = self._bucket_of[slot]
        self._pending[bucket] -= 1
        if self._pending[bucket] == 0 and bucket != self._flags_bucket:
            self._bucket_ready(bucket)

    def _check_gradient_kind(self, slot: int, grad: torch.Tensor) -> None:
        if grad.is_sparse:
            raise RuntimeError(
                f"parameter '{self._names[slot]}' received a sparse gradient; commsched reduces "
                "dense gradients only. Use nn.Embedding(..., sparse=False)."
            )
        if grad.requires_grad:
            raise RuntimeError(
                f"parameter '{self._names[slot]}' received a gradient that requires grad "
                "(backward(create_graph=True)); higher-order gradients cannot be reduced. "
                "Compute them with torch.autograd.grad on an unprepared copy of the model."
            )

    def _begin_backward(self) -> None:
        if self.backend.server_side_update and self._sync_enabled and self._iteration >= 0 and not self._stepped:
            raise RuntimeError(
                "backward() ran twice without optimizer.step() in between. With "
                "Strategy(backend='ps') every synchronised backward() is an update on the servers; "
                "accumulate gradients over micro-batches inside model.no_sync() and call "
                "optimizer.step() after the last backward()."
            )
        # The previous iteration's reductions write into the buffers we are about to fill.
        self.synchronize()
        if not self.buckets:
            self._build(list(range(self._num_slots)))
        self.phase = Phase.BACKWARD
        self._sync_this_backward = self._sync_enabled
        self._ready = [False] * self._num_slots
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if not self._sync_this_backward:
            return
        self._stepped = False
        self._iteration += 1
        plan = None
        if self._iteration == PLAN_ITERATION and self._profile is not None:
            started = time.perf_counter()
            with self._peer_failures_explained():
                plan = plan_on_rank0(self.partitions, self._profile, self.strategy.credit_bytes,
                                     self.process_group, self.strategy.timeout_s)
            self._executor = PlanExecutor(self.partitions, plan, self.strategy.credit_bytes)
            logger.info(
                "commsched: agreed on an order of %d partitions in %d buckets in %.1f ms",
                len(plan), len(self.buckets), (time.perf_counter() - started) * 1e3,
            )
        self.backend.begin_iteration(self._iteration, plan)
        n = len(self.buckets)
        self._pending = list(self._bucket_param_counts)
        self._executor.reset(n)
        self._handles = [[] for _ in range(n)]
        self._reduced = [False] * n
        self._updated = [False] * n
        self._outstanding = n
        self._step_hyperparameters = None
        self._flags_settled = False
        self._globally_unused = frozenset()
        self._user_may_touch_grads = False
        self._grads_released = False
        if self._tracer is not None:
            self._tracer.iteration = self._iteration
            if self._iteration % 20 == 0:
                self._tracer.write()
        self._overlap_now = self.overlap_enabled and self._iteration >= WARMUP_ITERATIONS
        self._profiling = self._profile is not None and 0 < self._iteration < PLAN_ITERATION
        if self._profiling:
            self._profile.begin()

    def _bucket_ready(self, bucket_index: int) -> None:
        bucket = self.buckets[bucket_index]
        if self.world_size > 1 and not self.backend.server_side_update:
            bucket.flat[: bucket.grad_numel].div_(self.world_size)
        if bucket_index == self._flags_bucket and bucket.tail.numel():
            bucket.tail.copy_(torch.tensor(self._has_grad, dtype=bucket.dtype))
        self._launch_version[bucket_index] = bucket.flat._version
        if self._profiling:
            self._profile.bucket_ready(bucket_index)
        if self._tracer is not None:
            self._ready_us[bucket_index] = now_us()
        with self._issuing():
            self._executor.mark_ready(bucket_index)
            self._executor.pump(self._launch_partition, _is_completed)

    def _launch_partition(self, partition: Partition) -> Handle:
        if self._profiling:
            self._profile.launched(partition.nbytes)
        handle = self.backend.launch(self.buckets[partition.bucket], partition.start, partition.end)
        self._handles[partition.bucket].append(handle)
        if self._tracer is not None:
            self._trace_partition(partition, handle)
        if self.strategy.credit_bytes is not None and not self.backend.is_local:
            self._when_complete(handle, self._on_partition_complete)
        return handle

    def _on_partition_complete(self) -> None:
        """Runs on a communication thread: returned credit may let the next partition go.

        Without this, credit would only come back at the next gradient hook, and
        the link would idle through a long layer's backward computation.
        """
        if self.phase is not Phase.BACKWARD or self._issuing_thread == threading.get_ident():
            # Everything is issued at the end of backward anyway; or the partition
            # completed before its callback was attached, inside our own pump.
            return
        with self._issuing():
            try:
                if self.phase is Phase.BACKWARD:
                    self._executor.pump(self._launch_partition, _is_completed)
            except Exception as error:  # noqa: BLE001 - surfaced on the main thread
                self._issue_error = error

    def _when_complete(self, handle: Handle, callback) -> None:
        """Run ``callback`` when ``handle`` completes, counted until it has run.

        [Note: callbacks at exit] Completion callbacks are Python code run by a
        communication thread. One still waiting for the interpreter lock while
        the process exits would be torn down mid-call, which aborts the process;
        `drain_callbacks` (also run at exit) waits until none is pending.
        """
        with self._callbacks_done:
            self._callbacks_pending += 1

        def counted() -> None:
            try:
                callback()
            finally:
                with self._callbacks_done:
                    self._callbacks_pending -= 1
                    if not self._callbacks_pending:
                        self._callbacks_done.notify_all()

        handle.on_complete(counted)

    def drain_callbacks(self, timeout_s: float = 10.0) -> None:
        """Wait until every completion callback has run (see [Note: callbacks at exit])."""
        with self._callbacks_done:
            self._callbacks_done.wait_for(lambda: not self._callbacks_pending, timeout=timeout_s)

    @contextmanager
    def _peer_failures_explained(self) -> Iterator[None]:
        """Let the backend name the lost rank when a collective among the workers fails."""
        try:
            yield
        except CommunicationTimeout as error:
            self.backend.explain_failure(error)
            raise

    @contextmanager
    def _issuing(self) -> Iterator[None]:
        with self._issue_lock:
            self._issuing_thread = threading.get_ident()
            try:
                yield
            finally:
                self._issuing_thread = None

    def _trace_partition(self, partition: Partition, handle: Handle) -> None:
        tracer, issued = self._tracer, now_us()
        name = f"P{partition.pid} b{partition.bucket}"
        tracer.span("queue", name, self._ready_us[partition.bucket], issued, bytes=partition.nbytes)
        self._when_complete(handle, lambda: tracer.span("wire", name, issued, now_us(), bytes=partition.nbytes,
                                               priority=partition.priority))

    def _end_backward(self) -> None:
        """Runs once the autograd engine has finished this backward pass."""
        self.phase = Phase.IDLE
        if not self._sync_this_backward:
            return
        if not all(self._ready):
            self._resolve_unready_parameters()
        self._bucket_ready(self._flags_bucket)
        with self._issuing():
            self._executor.pump(self._launch_partition, _is_completed, ignore_credit=True)
        if self._issue_error is not None:
            error, self._issue_error = self._issue_error, None
            raise error
        assert self._executor.done, "every partition must be issued by the end of backward"
        if not self._overlap_now:
            for bucket in range(len(self.buckets)):
                self._complete_bucket(bucket)
        if self._profiling:
            self._profile.end()

    def _resolve_unready_parameters(self) -> None:
        for slot, ready in enumerate(self._ready):
            if ready:
                continue
            param, view = self._params[slot], self._views[slot]
            grad = param.grad
            if grad is None:
                view.zero_()
                self._unowned_grad_slots.append(slot)
            elif grad is not view:
                view.copy_(grad)
                param.grad = view
            self._has_grad[slot] = grad is not None
            self._ready[slot] = True
            bucket = self._bucket_of[slot]
            self._pending[bucket] -= 1
            if self._pending[bucket] == 0 and bucket != self._flags_bucket:
                self._bucket_ready(bucket)

    # ------------------------------------------------------- completion side
    def _complete_bucket(self, bucket: int) -> None:
        """Wait for ``bucket``'s reduction; update it if step() released updates."""
        tracer = self._tracer
        if not self._reduced[bucket]:
            started = now_us() if tracer is not None else 0.0
            for handle in self._handles[bucket]:
                handle.wait(self.strategy.timeout_s)
            self._reduced[bucket] = True
            if tracer is not None:
                tracer.span("gates", f"wait b{bucket}", started, now_us())
        if not self._flags_settled and (bucket == self._flags_bucket or self._unowned_grad_slots):
            self._settle_flags()
        if self._step_hyperparameters is not None and not self._updated[bucket]:
            if self.updater is not None:
                started = now_us() if tracer is not None else 0.0
                self.updater.update(bucket, self._step_hyperparameters, self._globally_unused)
                if tracer is not None:
                    tracer.span("update", f"update b{bucket}", started, now_us())
            self._updated[bucket] = True
            self._outstanding -= 1

    def _settle_flags(self) -> None:
        """Read which parameters some rank used; see [Note: unused parameters]."""
        flags = self._flags_bucket
        if not self._reduced[flags]:
            for handle in self._handles[flags]:
                handle.wait(self.strategy.timeout_s)
            self._reduced[flags] = True
        self._flags_settled = True
        if not self._unowned_grad_slots:
            return
        if self.backend.server_side_update:
            # Workers keep their own gradients: a parameter this rank did not use keeps grad=None.
            self._unowned_grad_slots = []
            return
        used_by_some_rank = self.buckets[flags].tail.tolist()
        unused = []
        for slot in self._unowned_grad_slots:
            if used_by_some_rank[slot] == 0:
                unused.append(slot)
            elif not self._grads_released:
                self._params[slot].grad = self._views[slot]
        self._globally_unused = frozenset(unused)
        self._unowned_grad_slots = []

    def _gate(self, module: torch.nn.Module, args: object) -> None:
        """Forward pre-hook: wait only for this module's own parameters."""
        if self._outstanding:
            for bucket in self._gate_buckets[id(module)]:
                if not self._updated[bucket]:
                    self._complete_bucket(bucket)

    # ------------------------------------------------- gradients the user touches
    def _gradient_versions_changed(self) -> bool:
        return any(
            bucket.flat._version != version
            for bucket, version in zip(self.buckets, self._launch_version, strict=True)
        )

    def _note_gradient_changes_before_overlap(self) -> None:
        if self.overlap_enabled and self._gradient_versions_changed():
            self._overlap_off_reason = (
                "gradients are modified between backward() and step() (clip_grad_norm_, "
                "GradScaler.unscale_, ...), which needs every reduction finished first"
            )
            logger.warning("commsched: overlap_forward is off from now on: %s", self._overlap_off_reason)

    def _check_gradients_untouched(self) -> None:
        if self._user_may_touch_grads or not self._gradient_versions_changed():
            return
        raise RuntimeError(
            "gradients were modified between backward() and step() while their reductions were "
            "still in flight (Strategy.overlap_forward=True), so this step would be wrong. Call "
            "optimizer.synchronize() before changing gradients (clip_grad_norm_, GradScaler."
            "unscale_), or use Strategy(overlap_forward=False)."
        )

    # -------------------------------------------------------- forward checks
    def _before_forward(self, module: torch.nn.Module, args: object) -> None:
        if self._tracer is not None and torch.is_grad_enabled() and module.training:
            self._tracer.end("compute", 0, "iteration")
            self._tracer.begin("compute", 0)
        if self.phase is Phase.BACKWARD:
            raise RuntimeError(
                "the previous backward pass did not finish (it raised an exception), so some "
                "gradient reductions never ran and the ranks are out of step. Restart training "
                "from a checkpoint."
            )
        if self._take_fingerprint() != self._fingerprint:
            raise RuntimeError(self._explain_parameter_change())
        if (
            self.strategy.broadcast_buffers
            and self.world_size > 1
            and self._sync_enabled
            and torch.is_grad_enabled()
        ):
            buffers = [b for m in self._modules for b in m._buffers.values() if b is not None]
            if buffers:
                broadcast_from_rank0(buffers, self.buffer_group, self.strategy.timeout_s)
        if self._outstanding:
            for bucket in self._root_gate_buckets:
                if not self._updated[bucket]:
                    self._complete_bucket(bucket)
        if not self.buckets and torch.is_grad_enabled() and self._recorder is None:
            self._recorder = ForwardRecorder(self.module, self._params)
            self._after_first_forward_handle = self.module.register_forward_hook(
                self._after_first_forward, always_call=True
            )

    def _after_first_forward(self, module: torch.nn.Module, args: object, output: object) -> None:
        recorder, self._recorder = self._recorder, None
        self._after_first_forward_handle.remove()
        recorder.finish()
        with self._peer_failures_explained():
            order = agree_on_order(recorder.parameter_order(self._params), self.process_group,
                                   self.strategy.timeout_s)
        self._build(order, recorder.used_before_owner)

    def _take_fingerprint(self) -> list[object]:
        """Cheap identity of the module tree and its trainable parameters."""
        fingerprint: list[object] = []
        for module in self._modules:
            fingerprint.extend(map(id, module._modules.values()))
            for param in module._parameters.values():
                if param is None:
                    fingerprint.append(None)
                else:
                    fingerprint.append((id(param), param.requires_grad, param.shape))
        return fingerprint

    def _describe_parameters(self) -> dict[str, tuple[int, bool, tuple[int, ...]]]:
        return {
            name: (id(p), p.requires_grad, tuple(p.shape))
            for name, p in self.module.named_parameters()
        }

    def _explain_parameter_change(self) -> str:
        before, now = self._snapshot, self._describe_parameters()
        changes = [f"'{n}' was added" for n in now if n not in before]
        changes += [f"'{n}' was removed" for n in before if n not in now]
        for name in before.keys() & now.keys():
            (old_id, old_grad, old_shape), (new_id, new_grad, new_shape) = before[name], now[name]
            if old_id != new_id:
                changes.append(f"'{name}' was replaced by a new Parameter")
            elif old_grad != new_grad:
                changes.append(f"'{name}' changed requires_grad from {old_grad} to {new_grad}")
            elif old_shape != new_shape:
                changes.append(f"'{name}' changed shape from {old_shape} to {new_shape}")
        if not changes:
            changes.append("a submodule was added, removed or replaced")
        return (
            "the model's parameters changed after commsched.prepare(): "
            + "; ".join(sorted(changes))
            + ". Gradient buckets are built once, at prepare(); make every change "
            "(adding, removing, replacing, freezing or resizing parameters) before "
            "calling commsched.prepare()."
        )


def _at_exit(reducer_ref: weakref.ref) -> None:
    reducer = reducer_ref()
    if reducer is not None:
        reducer.finish_at_exit()


def _is_completed(handle: Handle) -> bool:
    return handle.is_completed()
