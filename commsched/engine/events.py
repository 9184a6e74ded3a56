"""What the core reports as it runs: events for observers (the trace, the planning profile), and
labels for a profiler.

The core emits each event once, at the moment it happens, through one
`EventBus`; observers subscribe to what they need and the core never knows who
listens. With no observer the core emits nothing (``EventBus.observed``), and
takes no time stamps for it. Times are ``time.perf_counter()`` seconds. Events
about partitions may arrive on a communication thread.

``torch.profiler`` labels (`phase`) name the phases a user sees in a profile:
``commsched::gate`` (a module waiting for its buckets), ``commsched::reduce_wait``
(the host waiting for a bucket's reduction), ``commsched::update`` (a bucket's
update), ``commsched::step`` and ``commsched::warmup`` (the end of warm-up: the
cost model's choice, the plan). A label costs about 13 microseconds where no
profiler runs (``record_function``'s own entry), too much for a hook run per
module per iteration; so one is made only while a profiler records.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, ContextManager

import torch
from torch.profiler import record_function

if TYPE_CHECKING:
    from commsched.comm.transport import Handle
    from commsched.layout.grad_layout import GradLayout
    from commsched.layout.partitions import Partition


class Observer:
    """Subscribe to an `EventBus`; override the events of interest (the rest do nothing)."""

    def layout_built(self, layout: GradLayout, placement: str | None) -> None:
        """The buckets and partitions exist (``placement``: where the transport sends each, if it says)."""

    def iteration_started(self, iteration: int) -> None:
        """A synchronised backward pass begins: iteration ``iteration`` (0, 1, ...)."""

    def forward_started(self) -> None:
        """The prepared model's forward pass begins."""

    def gradient_ready(self, slot: int) -> None:
        """Parameter ``slot``'s gradient for this backward pass is complete (hot path)."""

    def bucket_ready(self, bucket: int) -> None:
        """Every gradient of ``bucket`` is final and its partitions may be issued."""

    def partition_issued(self, partition: Partition, handle: Handle) -> None:
        """``partition`` went on the wire; ``handle`` completes when it has arrived."""

    def partition_completed(self, partition: Partition, handle: Handle) -> None:
        """Where completions have no callback (NCCL): ``partition`` was found complete now, at a
        gradient hook or a gate (its ``handle``, as issued)."""

    def backward_finished(self) -> None:
        """Every partition is issued (without forward overlap, every reduction has completed)."""

    def reduction_waited(self, bucket: int, start_s: float, end_s: float) -> None:
        """The training thread waited for ``bucket``'s reduction: communication not hidden."""

    def bucket_updated(self, bucket: int, start_s: float, end_s: float) -> None:
        """``bucket``'s parameters were updated."""

    def update_waited(self, bucket: int, start_s: float, end_s: float) -> None:
        """The training thread waited for what ``bucket``'s update started (sharded state's
        all-gather of the updated parameters): communication not hidden."""

    def step_finished(self, start_s: float, end_s: float) -> None:
        """``optimizer.step()`` returned."""

    def closed(self) -> None:
        """The model was released or the process exits: flush what is kept."""


class EventBus(Observer):
    """Hands every event to each subscribed observer, in subscription order."""

    def __init__(self) -> None:
        self._observers: tuple[Observer, ...] = ()
        self.observed = False
        """Some observer is subscribed: the core emits events (and times them) only then."""

    def subscribe(self, observer: Observer) -> None:
        self._observers += (observer,)
        self.observed = True

    def unsubscribe(self, observer: Observer) -> None:
        self._observers = tuple(o for o in self._observers if o is not observer)
        self.observed = bool(self._observers)

    def layout_built(self, layout: GradLayout, placement: str | None) -> None:
        for observer in self._observers:
            observer.layout_built(layout, placement)

    def iteration_started(self, iteration: int) -> None:
        for observer in self._observers:
            observer.iteration_started(iteration)

    def forward_started(self) -> None:
        for observer in self._observers:
            observer.forward_started()

    def gradient_ready(self, slot: int) -> None:
        for observer in self._observers:
            observer.gradient_ready(slot)

    def bucket_ready(self, bucket: int) -> None:
        for observer in self._observers:
            observer.bucket_ready(bucket)

    def partition_issued(self, partition: Partition, handle: Handle) -> None:
        for observer in self._observers:
            observer.partition_issued(partition, handle)

    def partition_completed(self, partition: Partition, handle: Handle) -> None:
        for observer in self._observers:
            observer.partition_completed(partition, handle)

    def backward_finished(self) -> None:
        for observer in self._observers:
            observer.backward_finished()

    def reduction_waited(self, bucket: int, start_s: float, end_s: float) -> None:
        for observer in self._observers:
            observer.reduction_waited(bucket, start_s, end_s)

    def bucket_updated(self, bucket: int, start_s: float, end_s: float) -> None:
        for observer in self._observers:
            observer.bucket_updated(bucket, start_s, end_s)

    def update_waited(self, bucket: int, start_s: float, end_s: float) -> None:
        for observer in self._observers:
            observer.update_waited(bucket, start_s, end_s)

    def step_finished(self, start_s: float, end_s: float) -> None:
        for observer in self._observers:
            observer.step_finished(start_s, end_s)

    def closed(self) -> None:
        for observer in self._observers:
            observer.closed()


_NOTHING = contextlib.nullcontext()

try:
    _profiler_enabled = torch._C._autograd._profiler_enabled
except AttributeError:  # a torch without it: always label
    def _profiler_enabled() -> bool:
        return True


def phase(name: str) -> ContextManager[object]:
    """``with phase("commsched::update"):`` labels what runs inside in a profile, if one is being taken."""
    return record_function(name) if _profiler_enabled() else _NOTHING
