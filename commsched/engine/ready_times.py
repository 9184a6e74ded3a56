"""Rank 0's warm-up timeline: when each gradient was ready, how long the forward pass took,
and how fast partitions reduced while training; what the cost model and the plan start from."""

from __future__ import annotations

import statistics
from typing import Any

from commsched.comm.transport import Handle
from commsched.device import HostSeam
from commsched.engine.events import Observer
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.layout.partitions import Partition
from commsched.planning.plans import WarmupTimeline, wire_bytes_per_s
from commsched.planning.schedule import LinkModel

Seconds = tuple[list[list[float]], list[float], list[tuple[list[tuple[float, int]], float]]]
"""A profile's stamps in seconds: per iteration each slot's ready time, the forward passes, the transfers."""


class ReadyTimeProfile(Observer):
    """One rank's timeline of the warm-up backward passes (run without overlap).

    An observer of the core's events, recording iterations 1 to
    ``WARMUP_ITERATIONS - 1`` (the first is slow): when each parameter's
    gradient became ready (relative to the start of the backward pass), how long
    the forward pass before it took, and when each partition was issued and
    when the last one completed. The latter give the link's speed under the real
    load of training (computation competing with communication for the same
    cores): see `loaded_bytes_per_s`. Per parameter, not per bucket, so the
    timeline holds for any bucket layout the cost model considers.

    Times are taken by ``clock``: on a GPU, events on the stream (the host
    launches a gradient's kernels long before the device has computed it, and
    learns of a reduction's end only when it waits), read once, when the
    profile is first asked for its figures at the end of warm-up.
    """

    def __init__(self, num_slots: int, clock: HostSeam | None = None):
        self._num_slots = num_slots
        self._clock = HostSeam() if clock is None else clock
        self._ready: list[tuple[Any, list[Any]]] = []
        """Per iteration: its start, and when each slot's gradient was ready (None: it was not)."""
        self._forward: list[tuple[Any, Any]] = []
        """Per iteration: when its forward pass and its backward pass started."""
        self._transfers: list[tuple[Any, list[tuple[Any, int]], Any]] = []
        """Per iteration: its start, (when each partition was issued, its bytes), and when all had completed."""
        self._recording = False
        self._current: list[Any] = []
        self._issued: list[tuple[Any, int]] = []
        self._start: Any = None
        self._forward_start: Any = None
        self._seconds: Seconds | None = None
        """The stamps as seconds, once asked for."""

    def forward_started(self) -> None:
        self._forward_start = self._clock.stamp()

    def iteration_started(self, iteration: int) -> None:
        self._recording = 0 < iteration < WARMUP_ITERATIONS
        if self._recording:
            self._start = self._clock.stamp()
            if self._forward_start is not None:
                self._forward.append((self._forward_start, self._start))
                self._seconds = None
            self._current = [None] * self._num_slots
            self._issued = []

    def gradient_ready(self, slot: int) -> None:
        if self._recording:
            self._current[slot] = self._clock.stamp()

    def partition_issued(self, partition: Partition, handle: Handle) -> None:
        if self._recording:
            self._issued.append((self._clock.stamp(), partition.nbytes))

    def backward_finished(self) -> None:
        """During warm-up, every reduction of the iteration has completed by now (on a GPU: the
        stream is ordered after them)."""
        if not self._recording:
            return
        self._recording = False
        self._seconds = None
        self._ready.append((self._start, self._current))
        if self._issued:
            self._transfers.append((self._start, self._issued, self._clock.stamp()))

    def _in_seconds(self) -> Seconds:
        """Every stamp as seconds from its iteration's start (read once: on a GPU, a wait for the events)."""
        if self._seconds is None:
            since = self._clock.seconds_between
            ready = [[0.0 if stamp is None else since(start, stamp) for stamp in stamps]
                     for start, stamps in self._ready]
            forward = [since(began, start) for began, start in self._forward]
            transfers = [([(since(start, at), nbytes) for at, nbytes in issued], since(start, done))
                         for start, issued, done in self._transfers]
            self._seconds = (ready, forward, transfers)
        return self._seconds

    def median_slot_ready_s(self) -> list[float]:
        ready = self._in_seconds()[0]
        if not ready:
            return [0.0] * self._num_slots
        return [statistics.median(column) for column in zip(*ready)]

    def median_forward_s(self) -> float:
        forward = self._in_seconds()[1]
        return statistics.median(forward) if forward else 0.0

    def loaded_bytes_per_s(self, latency_s: float, idle_link: LinkModel | None = None) -> float | None:
        """The link's bandwidth while training, median over the iterations that bound it.

        Per iteration, the bandwidth with which partitions reduced one after the
        other, each from when it was issued and costing ``latency_s`` besides its
        bytes, all complete when they were seen complete (`wire_bytes_per_s`).
        Bytes over the time from the first issue to the last completion would
        count the link's idle time, waiting for gradients, as transfer: where
        computation sets the pace that halves the bandwidth, and a plan made
        for so slow a link holds back partitions that would have fitted.
        None if no iteration bounds it: their last partition took no longer
        than a latency, or the link's last busy period held too few of the
        bytes to tell its speed (judged at ``idle_link``'s, where measured).
        """
        idle_bytes_per_s = None if idle_link is None else idle_link.bytes_per_s
        fitted = [wire_bytes_per_s(issued, done_s, latency_s, idle_bytes_per_s)
                  for issued, done_s in self._in_seconds()[2]]
        bounded = [b for b in fitted if b is not None]
        return statistics.median(bounded) if bounded else None

    def timeline(self, latency_s: float, idle_link: LinkModel | None = None) -> WarmupTimeline:
        """What plans need of this profile, kept when it is dropped (see `WarmupTimeline`)."""
        return WarmupTimeline(tuple(self.median_slot_ready_s()), self.loaded_bytes_per_s(latency_s, idle_link),
                              latency_s, self.median_forward_s(), idle_link)
