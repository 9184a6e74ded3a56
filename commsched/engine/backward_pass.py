"""`BackwardPass`: everything one synchronised backward pass owns, from its first gradient on.

A pass lives from the first gradient hook of its backward until the next
synchronised backward begins: under forward overlap its reductions are still
in flight, and its updates pending, while the next forward pass runs. The next
pass waits for all of it and the object is dropped; nothing in it is ever
reset. Per bucket a pass goes: pending gradients -> ready (averaged, issued
by the `Dispatcher`) -> reduced (its handles waited for) -> updated (once
``step()`` released the update).

[Note: unused parameters] A parameter may get no gradient in an iteration on
some ranks or on all. When the transport sums partitions over the replicas,
each rank writes, per parameter, whether it holds a gradient into a few extra
elements at the end of the *flags bucket* (the one the next forward needs
first, whose gradients are ready last anyway); it is issued only at the end of
the backward pass, when every flag is known. The sum over ranks tells every
rank which parameters no rank used: those keep ``grad=None`` and are not
updated, exactly as in single-process training. No extra collective, and no
``find_unused_parameters`` switch. (A parameter server receives the flags with
each push instead, and a worker keeps its own ``grad=None``.)

[Note: nested backward passes] Reentrant activation checkpointing computes a
block's gradients in a backward pass of its own, nested in the outer one; a
parameter used both inside such a block and outside it (weight tying, a
penalty) gets its gradient accumulated twice, once per pass, and its bucket
must not go out before the second. The first pass of a model holds every bucket
until the end of backward and notes which parameters got their gradient twice;
later passes hold only their buckets, so the per-gradient path checks nothing
more than a flag it reads anyway. A second accumulation into
a bucket already issued (a pattern first seen later) is an error that says so.
"""

from __future__ import annotations

import bisect
import functools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from commsched.comm.transport import Handle, Transport
from commsched.device import HostSeam
from commsched.engine.completion import CallbackTracker
from commsched.engine.dispatch import Dispatcher
from commsched.engine.events import EventBus, phase
from commsched.engine.finite import FiniteCheck, PassVerdict, flag_nonfinite
from commsched.layout.grad_layout import GradLayout
from commsched.layout.partitions import Partition, Plan
from commsched.update.base import Hyperparameters, UpdatePolicy
from commsched.update.grad_scaling import GradScaling
from commsched.watch.guards import gradient_twice_error

UPDATES_AHEAD_PER_GATE = 1
"""Buckets a gate updates ahead of its own, at most (see [Note: ordered updates])."""


@dataclass
class IterationFigures:
    """What one synchronised iteration cost, as this rank saw it."""

    iteration: int
    partitions_issued: int = 0
    bytes_issued: int = 0
    exposed_wait_s: float = 0.0
    """Time the training thread waited for reductions (end of backward, gates,
    ``synchronize()``): communication that was not hidden."""
    update_s: float = 0.0
    """Time spent updating buckets."""
    host_waits: int | None = None
    """On a GPU, the waits and reads of the host on the device from this pass's start to the
    next's (see [Note: stream-ordered waits] in commsched/device.py); None on the CPU or while
    the pass runs."""


class BackwardPass:
    """One synchronised iteration's gradients, reductions and updates."""

    def __init__(
        self,
        iteration: int,
        layout: GradLayout,
        plan: Plan,
        transport: Transport,
        policy: UpdatePolicy,
        events: EventBus,
        tracker: CallbackTracker,
        timeout_s: float,
        overlapping: bool,
        held_buckets: frozenset[int] | None = None,
        finite_check: FiniteCheck | None = None,
        seam: HostSeam | None = None,
    ):
        """``finite_check``: `Strategy.check_finite` (see [Note: non-finite gradients]); ``seam``:
        how waits order the device's work (see [Note: stream-ordered waits] in commsched/device.py)."""
        self.iteration = iteration
        self.overlapping = overlapping
        """Forward overlap is on for this pass: ``step()`` releases the updates to the gates."""
        self._layout, self._transport, self._policy, self._events = layout, transport, policy, events
        self._timeout_s = timeout_s
        self._finite = finite_check
        self._verdict: PassVerdict | None = None
        """The finite check's verdict, once asked for (the same object each time)."""
        self._seam = HostSeam() if seam is None else seam
        self._host_waits_at_start = self._seam.host_waits
        num_buckets, num_slots = len(layout.buckets), len(layout.params)
        self._pending = list(layout.bucket_param_counts)
        self._ready = [False] * num_slots
        self.has_grad = [False] * num_slots
        """Per slot: whether this rank produced (or was given) a gradient in this pass."""
        self._handles: list[list[Handle]] = [[] for _ in range(num_buckets)]
        self._ready_marks: list[object] = [None] * num_buckets
        """Per bucket, on a device with streams: where its gradients are final (averaged, flags
        written), which a launch from another thread's stream must come after."""
        self._launch_versions = [0] * num_buckets
        self._reduced = [False] * num_buckets
        self._updated = [False] * num_buckets
        """Per bucket: its update ran (what it started may still be in flight)."""
        self._finished = [False] * num_buckets
        """Per bucket: its update is done, and awaited (`UpdatePolicy.wait_updated`)."""
        sharded = policy.sharded
        self._update_order = None if sharded is None else sharded.update_order
        """The order updates must run in, on every rank (`ShardedState.update_order`, laid out before
        a pass starts); None: any."""
        self._local_updates = frozenset() if sharded is None else sharded.local_updates
        order = self._update_order
        self._update_position = {} if order is None else {bucket: i for i, bucket in enumerate(order)}
        """Each bucket's place in `_update_order`."""
        self.outstanding = num_buckets
        """Buckets not yet finished (or marked done by a plain ``optimizer.step()``)."""
        self._unowned_slots: list[int] = []
        self._globally_unused: frozenset[int] = frozenset()
        self.views_handed: frozenset[int] = frozenset()
        """Slots whose zeroed bucket view was made their ``.grad`` as this backward started
        (see [Note: views ahead of backward]): without a gradient, they are None again."""
        self._flags_settled = False
        self.hyperparameters: Hyperparameters | None = None
        """Set by ``step()``: the updates are released, with these hyper-parameters."""
        # [Note: a pass's step state] What the user's calls did to this pass, each set by one of
        # the transitions under "step" below, never from outside.
        self._scaling: GradScaling | None = None
        """Set by ``step()`` under a ``GradScaler``: the loss scale and its inf/NaN verdict."""
        self._stepped = False
        self._grads_final = False
        """``synchronize()`` ran: gradients are averaged and may be changed before ``step()``."""
        self._synchronized_by_user = False
        """The user called ``optimizer.synchronize()`` after this pass's backward."""
        self._grads_released = False
        """``zero_grad(set_to_none=True)`` ran: settled gradients must not reappear as ``.grad``."""
        self._grads_cleared = False
        """``optimizer.zero_grad()`` ran after this pass's backward (either way)."""
        self.figures = IterationFigures(iteration)
        self._held = (frozenset(range(num_buckets)) if held_buckets is None else held_buckets) | {layout.flags_bucket}
        """Buckets issued only when the backward pass ends; see [Note: nested backward passes]."""
        self.repeated_slots: set[int] = set()
        """Slots whose gradient was accumulated twice in this pass (a nested backward pass)."""
        self._dispatcher = Dispatcher(
            plan, self._launch, tracker,
            credit_from_completions=plan.credit_bytes is not None and not transport.is_local
            and transport.completion_callbacks,
            seen_complete=None if transport.completion_callbacks else self._seen_complete,
        )
        self._polled = not transport.completion_callbacks
        """A gate asks the dispatcher which partitions are complete: no callback tells it (NCCL)."""

    # ---------------------------------------------------------------- backward
    @property
    def all_gradients_ready(self) -> bool:
        return all(self._ready)

    def gradient_ready(self, slot: int) -> None:
        """Parameter ``slot``'s gradient sits in its bucket; a complete bucket goes out."""
        bucket = self._layout.bucket_of[slot]
        if self._ready[slot]:
            # Accumulated again, in place, in its bucket: right only if not issued yet.
            if bucket not in self._held:
                raise RuntimeError(gradient_twice_error(self._layout.names[slot]))
            self.repeated_slots.add(slot)
            return
        self._ready[slot] = True
        self.has_grad[slot] = True
        self._pending[bucket] -= 1
        if self._pending[bucket] == 0 and bucket not in self._held:
            self._bucket_ready(bucket)

    def end_backward(self, without_gradients: bool = False) -> None:
        """The autograd engine is done: settle the parameters that got no gradient, issue the rest.

        ``without_gradients``: this rank contributes nothing (it shadows the
        others' iteration; see [Note: uneven inputs] in `commsched.engine.join`).
        """
        self._dispatcher.end_backward()
        if not all(self._ready):
            self._resolve_unready_parameters(without_gradients)
        flags = self._layout.flags_bucket
        for bucket in sorted(self._held - {flags}):
            self._bucket_ready(bucket)
        self._bucket_ready(flags)
        self._dispatcher.issue_remaining()

    def _bucket_ready(self, index: int) -> None:
        layout = self._layout
        bucket = layout.buckets[index]
        if self._finite is not None:
            self._finite.check(bucket)
        self._transport.bucket_ready(bucket)
        if index == layout.flags_bucket and bucket.tail.numel():
            usage = bucket.tail[:len(self.has_grad)]
            usage.copy_(_host_tensor(self.has_grad, usage), non_blocking=True)
            if self._finite is not None:
                self._finite.write_slots(bucket.tail[len(self.has_grad):])
        seam = self._seam
        if seam.orders_streams:
            self._ready_marks[index] = seam.mark()
            seam.check()
        self._launch_versions[index] = bucket.flat._version
        if self._events.observed:
            self._events.bucket_ready(index)
        self._dispatcher.bucket_ready(index)

    def _launch(self, partition: Partition) -> Handle:
        """Called by the dispatcher, on the training thread or a communication thread.

        On a device with streams, the launching thread's stream first waits for the bucket's
        gradients: a completion callback runs on another stream than the backward pass's, and
        the collective would read the bucket before its gradients and ``div_`` ran there."""
        bucket = partition.bucket
        mark = self._ready_marks[bucket]
        if mark is not None:
            self._seam.order_after(mark)
        handle = self._transport.launch(partition, self._layout.buckets[bucket], self.has_grad)
        self._handles[bucket].append(handle)
        figures = self.figures
        figures.partitions_issued += 1
        figures.bytes_issued += partition.nbytes
        if self._events.observed:
            self._events.partition_issued(partition, handle)
        return handle

    def _seen_complete(self, partition: Partition, handle: Handle) -> None:
        """Where completions have no callback: the dispatcher found ``partition`` complete."""
        if self._events.observed:
            self._events.partition_completed(partition, handle)

    def _resolve_unready_parameters(self, without_gradients: bool) -> None:
        layout = self._layout
        for slot, ready in enumerate(self._ready):
            if ready:
                continue
            param, view = layout.params[slot], layout.views[slot]
            grad = None if without_gradients else param.grad
            if grad is view and slot in self.views_handed:
                grad = param.grad = None
            if grad is None:
                view.zero_()
                self._unowned_slots.append(slot)
            elif grad is not view:
                view.copy_(grad)
                param.grad = view
            self.has_grad[slot] = grad is not None
            self._ready[slot] = True
            bucket = layout.bucket_of[slot]
            self._pending[bucket] -= 1
            if self._pending[bucket] == 0 and bucket not in self._held:
                self._bucket_ready(bucket)

    # -------------------------------------------------------------- completion
    def complete_buckets(self, buckets: Sequence[int]) -> None:
        """Wait for these buckets' reductions; update those ``step()`` released."""
        if self._polled:
            self._dispatcher.poll()
        if self._update_order is not None and self.hyperparameters is not None:
            self._complete_in_order(buckets)
            return
        for bucket in buckets:
            if not self._updated[bucket]:
                self._complete_bucket(bucket)
        self._wait_updated(buckets)

    def complete_all(self) -> None:
        buckets = range(len(self._layout.buckets))
        if self._update_order is not None and self.hyperparameters is not None:
            self._complete_in_order(buckets)
            return
        for bucket in buckets:
            self._complete_bucket(bucket)
        self._wait_updated(buckets)

    def _complete_in_order(self, buckets: Sequence[int]) -> None:
        """[Note: ordered updates] A policy whose updates start collectives (sharded state's
        all-gathers) gets them in `ShardedState.update_order` on every rank: the buckets
        asked for and every bucket before them in that order are updated, then the next one
        if its reduction is already complete (its all-gather then overlaps the forward pass up
        to its gate); then the ones asked for are awaited.

        One ahead per gate, not every completed one: updates run on the training thread, and
        six of them in one gate (the emulated ResNet-50 at 2 hosts) held its first layers for
        5 ms, where spread over the next gates they ran while the device computed. The cost:
        an all-gather may start a few gates later than its reduction allowed, so it can end
        after its gate where the gates come close together; on the 22M MLP, where the link
        sets the pace, the iteration did not get slower (1.68 times `AllReduce()`, against 1.75)."""
        order, position = self._update_order, self._update_position
        wanted = [b for b in buckets if not self._updated[b]]
        last = max((position[b] for b in wanted), default=-1)
        for bucket in order[:last + 1]:
            if not self._updated[bucket]:
                if bucket in self._local_updates:
                    self._update_ahead_of(bucket)
                self._complete_bucket(bucket)
        ahead = UPDATES_AHEAD_PER_GATE
        for bucket in order[last + 1:]:
            if ahead == 0:
                break
            if self._updated[bucket]:
                continue
            if not self._reduction_complete(bucket):
                break
            self._complete_bucket(bucket)
            ahead -= 1
        self._wait_updated(buckets)

    def _reduction_complete(self, bucket: int) -> bool:
        """Without blocking: every partition of ``bucket`` has been reduced (all are issued by the
        end of backward: see [Note: everything goes by the end of backward] in `commsched.engine.dispatch`)."""
        handles = self._handles[bucket]
        return self._reduced[bucket] or (bool(handles) and all(h.is_completed() for h in handles))

    def _update_ahead_of(self, local: int) -> None:
        """[Note: updates ahead of a local bucket] Before waiting for the reduction of a bucket
        whose update starts no collective (`ShardedState.local_updates`: sharded state's bucket
        kept whole, the one the forward pass needs first), update the buckets after it in
        `ShardedState.update_order` whose reductions complete meanwhile, in that order, so that
        their all-gathers start. Traced (the emulated ResNet-50, 8 hosts at 1 Gbit/s, reduce-
        scatter), the first gate waited 15 ms for that bucket's all-reduce, a latency-bound 1 MiB
        that leaves the link half idle, while the next bucket's reduction had long been complete;
        its all-gather began only when the gate opened, and the forward pass then waited for it.
        Started during that wait, it shares the link with that all-reduce (which took 34-48 ms
        instead of 15), and no gate waits for a gather: at 8 hosts, iterations 1-5% faster at
        1 and 0.5 Gbit/s (docs/records/2026-11-28-reduce-scatter-at-eight-hosts.md).

        Only the all-gathers' start times change, never their order: they are still issued in
        `update_order` on every rank, skipping only buckets that start nothing, and a gate may
        already update ahead of itself where reductions are complete (`UPDATES_AHEAD_PER_GATE`).
        Everything runs on the training thread, which would otherwise sit idle in this wait.
        Not where a bucket's update needs the flags of which parameters some rank used or of
        non-finite gradients (they come with the last reduction), nor on CUDA, where a
        collective's completion callback fires when it is enqueued, not when it ends (and NCCL
        runs the all-gathers in stream order anyway)."""
        if self._layout.buckets[local].flat.device.type != "cpu" or not self._handles[local]:
            return
        if self._every_update_needs_flags():
            return
        order, local_updates = self._update_order or (), self._local_updates
        after = order[self._update_position[local] + 1:]
        while not self._reduction_complete(local):
            following = next((b for b in after if not self._updated[b] and b not in local_updates), None)
            if following is None or not self._handles[following]:
                return
            if self._reduction_complete(following):
                self._complete_bucket(following)
                continue
            either = threading.Event()
            for handle in (*self._handles[local], *self._handles[following]):
                if not handle.is_completed():
                    handle.on_complete(either.set)
            if not either.wait(self._timeout_s):
                return  # the wait for ``local`` itself names what did not finish

    def start_updates(self) -> None:
        """On a rank out of batches under ``Join`` (sharded state), once the others stepped: every
        bucket's update starts now, in `ShardedState.update_order`; the next `complete_all` awaits them."""
        for bucket in self._update_order or range(len(self._layout.buckets)):
            if not self._updated[bucket]:
                self._complete_bucket(bucket)

    def _wait_updated(self, buckets: Sequence[int]) -> None:
        """The updates of these buckets have finished (see `UpdatePolicy.wait_updated`)."""
        for bucket in buckets:
            if self._updated[bucket] and not self._finished[bucket]:
                started = time.perf_counter()
                self._policy.wait_updated(bucket)
                finished = time.perf_counter()
                self.figures.exposed_wait_s += finished - started
                if self._update_order is not None:
                    if self._events.observed:
                        self._events.update_waited(bucket, started, finished)
                self._finished[bucket] = True
                self.outstanding -= 1

    def _complete_bucket(self, bucket: int) -> None:
        if not self._reduced[bucket]:
            self._wait_reduced(bucket)
        if (bucket == self._layout.flags_bucket and not self._flags_settled) or self._every_update_needs_flags():
            self._settle_flags()
        if self.hyperparameters is not None and not self._updated[bucket]:
            started = time.perf_counter()
            with phase("commsched::update"):
                self._policy.update(bucket, self.hyperparameters, self._globally_unused, self.update_scaling)
            finished = time.perf_counter()
            self.figures.update_s += finished - started
            if self._events.observed:
                self._events.bucket_updated(bucket, started, finished)
            self._updated[bucket] = True

    def _every_update_needs_flags(self) -> bool:
        """The flags not yet read, and every update needs them: this rank left parameters without
        gradients (some rank may have used them), or non-finite gradients skip the step."""
        return not self._flags_settled and (bool(self._unowned_slots) or self._finite is not None)

    def settled(self, bucket: int) -> bool:
        """Nothing of this pass still writes or reads the bucket's gradients (a reduction or an update)."""
        return self._reduced[bucket] and (self._finished[bucket] or self.hyperparameters is None)

    def _wait_reduced(self, bucket: int) -> None:
        started = time.perf_counter()
        seam, timeout_s = self._seam, self._timeout_s
        what = _reduction_of(bucket)
        with phase("commsched::reduce_wait"):
            for handle in self._handles[bucket]:
                seam.settle(handle, timeout_s, what)
        self._reduced[bucket] = True
        finished = time.perf_counter()
        self.figures.exposed_wait_s += finished - started
        if self._events.observed:
            self._events.reduction_waited(bucket, started, finished)

    def _settle_flags(self) -> None:
        """Read which parameters some rank used; see [Note: unused parameters]."""
        layout = self._layout
        flags = layout.flags_bucket
        if not self._reduced[flags]:
            self._wait_reduced(flags)
        self._flags_settled = True
        tail = layout.buckets[flags].tail
        if self._finite is not None:
            self._finite.settle(tail[len(layout.params):], self._names_of_nonfinite)
        if not self._unowned_slots:
            return
        if not tail.numel():
            # The servers were told with each push; this rank keeps its own grad=None.
            self._unowned_slots = []
            return
        self._seam.host_read()
        used_by_some_rank = tail.tolist()
        unused = []
        for slot in self._unowned_slots:
            if used_by_some_rank[slot] == 0:
                unused.append(slot)
            elif not self._grads_released:
                layout.params[slot].grad = layout.views[slot]
        self._globally_unused = frozenset(unused)
        self._unowned_slots = []

    @property
    def update_scaling(self) -> GradScaling | None:
        """What each update takes as its ``found_inf``: a ``GradScaler``'s verdict, or the finite check's."""
        if self._scaling is not None or self._finite is None:
            return self._scaling
        if not self._flags_settled:
            self._settle_flags()
        return self._finite.verdict

    @property
    def skipped_as_nonfinite(self) -> bool:
        """`Strategy.check_finite` found inf or NaN on some rank, and no ``GradScaler`` rules (a host read)."""
        verdict = self.update_scaling
        if self._finite is None or self._scaling is not None or verdict is None:
            return False
        self._seam.host_read()
        return verdict.skipped

    def gradients_hold_nonfinite(self) -> bool:
        """Whether some ``param.grad`` holds inf or NaN now (a ``step()`` again on the same gradients),
        where it holds the average on this rank."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for slot, param in enumerate(self._layout.params):
            grad = None if param.grad is None else self._averaged_part(slot, param.grad)
            if grad is not None:
                groups.setdefault((grad.device, grad.dtype), []).append(grad)
        for (device, _), grads in groups.items():  # the kernel takes one device and dtype at a time
            found = torch.zeros(1, device=device)
            flag_nonfinite(grads, found, torch.ones(1, device=device))
            self._seam.host_read()
            if found.item():
                return True
        return False

    def _names_of_nonfinite(self) -> list[str]:
        """The parameters whose averaged gradients hold inf or NaN (waits for every reduction)."""
        layout = self._layout
        for bucket in range(len(layout.buckets)):
            if not self._reduced[bucket]:
                self._wait_reduced(bucket)
        return [layout.names[slot] for slot, view in enumerate(layout.views)
                if (part := self._averaged_part(slot, view)) is not None and not torch.isfinite(part).all()]

    @property
    def _scattering(self) -> bool:
        """Whether buckets are reduce-scattered (see [Note: reduce-scattered buckets])."""
        scatter = self._transport.scatter
        return scatter is not None and scatter.active

    def gradients_left_scattered(self) -> bool:
        """Whether this pass's reduce-scattered gradients are still ``param.grad``, not cleared since
        (see [Note: reduce-scattered buckets]): a backward pass now would add to NaN. Read from one
        element of another rank's chunk per bucket, and only where ``optimizer.zero_grad()`` did not
        run (a gradient set to None, or zeroed in place, is not left)."""
        if self._grads_cleared or not self._scattering:
            return False
        layout, probes = self._layout, []
        for index, bucket in enumerate(layout.buckets):
            low, high = self._transport.scatter.averaged_range(bucket)
            if (low, high) == (0, bucket.grad_numel):
                continue  # all-reduced
            element = 0 if low > 0 else high
            if element >= bucket.grad_numel:
                continue
            slot = layout.bucket_slots[index][bisect.bisect_right(bucket.offsets, element) - 1]
            if layout.params[slot].grad is layout.views[slot]:
                probes.append(bucket.flat[element])
        if not probes:
            return False
        self._seam.host_read()
        return bool(torch.stack(probes).isnan().any())

    def _averaged_part(self, slot: int, grad: torch.Tensor) -> torch.Tensor | None:
        """``grad``, slot ``slot``'s gradient; where it is the view into a reduce-scattered bucket, only
        the part of it that holds the average on this rank, None if none does (see [Note:
        reduce-scattered buckets])."""
        layout = self._layout
        if grad is not layout.views[slot] or not self._scattering:
            return grad
        index = layout.bucket_of[slot]
        bucket = layout.buckets[index]
        offset = bucket.offsets[layout.bucket_slots[index].index(slot)]
        low, high = self._transport.scatter.averaged_range(bucket)
        low, high = max(low, offset), min(high, offset + grad.numel())
        return bucket.flat[low:high] if low < high else None

    def nonfinite_verdict(self) -> PassVerdict | None:
        """With `Strategy.check_finite`, once the flags are read: the verdict to tell, raising or
        warning if some rank's gradients held inf or NaN (`VerdictsToTell`). None under a
        ``GradScaler``, whose own verdict rules."""
        if self._finite is None or self._scaling is not None or not self._flags_settled:
            return None
        if self._verdict is None:
            self._verdict = PassVerdict(self._finite, self._layout.names, self._layout.bucket_slots)
        return self._verdict

    # -------------------------------------------------------------------- step
    @property
    def stepped(self) -> bool:
        """``step()`` ran after this pass's backward."""
        return self._stepped

    @property
    def synchronized_by_user(self) -> bool:
        return self._synchronized_by_user

    @property
    def has_new_gradients(self) -> bool:
        """Neither a ``step()`` nor ``zero_grad(set_to_none=True)`` came after this pass's backward:
        its reduced gradients are there to step on (else, [Note: a step without backward])."""
        return not (self._stepped or self._grads_released)

    @property
    def gradients_may_change(self) -> bool:
        """Every reduction is awaited (``synchronize()`` ran), so gradients may be changed in place."""
        return self._grads_final

    def synchronized(self, by_user: bool = False) -> None:
        """Every reduction and released update is done (``by_user``: ``optimizer.synchronize()``)."""
        self._grads_final = True
        self._synchronized_by_user = self._synchronized_by_user or by_user

    def zero_grad(self, set_to_none: bool) -> None:
        """``optimizer.zero_grad()`` after this pass's backward."""
        self._grads_cleared = True
        self._grads_released = self._grads_released or set_to_none

    def release_updates(self, hyperparameters: Hyperparameters, scaling: GradScaling | None = None) -> None:
        """``step()``: each bucket is updated once reduced (now, or at its gate)."""
        self._stepped = True
        self.hyperparameters = hyperparameters
        self._scaling = scaling

    def scaled_by(self, scaling: GradScaling | None) -> None:
        """An optimizer without per-bucket updates is about to step under ``scaling`` (a
        ``GradScaler``'s, or None): the verdict of `Strategy.check_finite` then defers to it."""
        self._scaling = scaling

    def stepped_whole(self) -> None:
        """The optimizer stepped every parameter itself (after every reduction)."""
        self._stepped = True
        self._updated = [True] * len(self._layout.buckets)
        self._finished = [True] * len(self._layout.buckets)
        self.outstanding = 0

    def gradients_changed(self) -> bool:
        """True if a bucket's gradients were changed in place after it was issued."""
        return any(
            bucket.flat._version != version
            for bucket, version in zip(self._layout.buckets, self._launch_versions, strict=True)
        )

    def wait_in_flight(self) -> None:
        """Wait for every operation this pass issued, updating nothing (the script ended inside the pass)."""
        for handles in self._handles:
            for handle in handles:
                handle.wait(self._timeout_s)

    def drop_handles(self) -> None:
        """Let go of every operation: once the pass is over, or at exit (see [Note: process groups at exit])."""
        seam = self._seam
        if seam.orders_streams:
            self.figures.host_waits = seam.host_waits - self._host_waits_at_start
            # Their buffers stay until the device has run what was queued so far (FSDP2's way: no record_stream).
            seam.hold(seam.mark(), self._handles)
        self._handles = [[] for _ in self._handles]
        self._dispatcher.forget_in_flight()


@functools.cache
def _reduction_of(bucket: int) -> str:
    """What a wait for ``bucket``'s reduction waits for, in a timeout's message (made once per bucket)."""
    return f"the reduction of gradient bucket {bucket}"


def _host_tensor(values: Sequence[bool], like: torch.Tensor) -> torch.Tensor:
    """``values`` on the host, to copy into ``like`` without making the host wait.

    For a CUDA tensor it is pinned: a copy from pageable memory would wait for
    the GPU to catch up with everything launched so far, every iteration. The
    pinned block is not reused before the copy has run (torch's host allocator
    records the copy's stream).
    """
    return torch.tensor(values, dtype=like.dtype, pin_memory=like.is_cuda)
