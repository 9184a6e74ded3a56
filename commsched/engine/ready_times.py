"""Rank 0's warm-up timeline: when each gradient was ready, how long the forward pass took,
and how fast partitions reduced while training; what the cost model and the plan start from."""

from __future__ import annotations

import statistics
import time

from commsched.comm.transport import Handle
from commsched.engine.events import Observer
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.layout.partitions import Partition
from commsched.planning.plans import WarmupTimeline, wire_bytes_per_s
from commsched.planning.schedule import LinkModel


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
    """

    def __init__(self, num_slots: int):
        self._num_slots = num_slots
        self._ready: list[list[float]] = []
        self._forward: list[float] = []
        self._transfers: list[tuple[list[tuple[float, int]], float]] = []
        """Per iteration: (when each partition was issued, its bytes), and when all had completed."""
        self._recording = False
        self._current: list[float] = []
        self._issued: list[tuple[float, int]] = []
        self._start = self._forward_start = 0.0

    def forward_started(self) -> None:
        self._forward_start = time.perf_counter()

    def iteration_started(self, iteration: int) -> None:
        self._recording = 0 < iteration < WARMUP_ITERATIONS
        if self._recording:
            self._start = time.perf_counter()
            if self._forward_start:
                self._forward.append(self._start - self._forward_start)
            self._current = [0.0] * self._num_slots
            self._issued = []

    def gradient_ready(self, slot: int) -> None:
        if self._recording:
            self._current[slot] = time.perf_counter() - self._start

    def partition_issued(self, partition: Partition, handle: Handle) -> None:
        if self._recording:
            self._issued.append((time.perf_counter() - self._start, partition.nbytes))

    def backward_finished(self) -> None:
        """During warm-up, every reduction of the iteration has completed by now."""
        if not self._recording:
            return
        self._recording = False
        self._ready.append(self._current)
        if self._issued:
            self._transfers.append((self._issued, time.perf_counter() - self._start))

    def median_slot_ready_s(self) -> list[float]:
        if not self._ready:
            return [0.0] * self._num_slots
        return [statistics.median(column) for column in zip(*self._ready)]

    def median_forward_s(self) -> float:
        return statistics.median(self._forward) if self._forward else 0.0

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
        fitted = [wire_bytes_per_s(issued, done_s, latency_s, idle_bytes_per_s) for issued, done_s in self._transfers]
        bounded = [b for b in fitted if b is not None]
        return statistics.median(bounded) if bounded else None

    def timeline(self, latency_s: float, idle_link: LinkModel | None = None) -> WarmupTimeline:
        """What plans need of this profile, kept when it is dropped (see `WarmupTimeline`)."""
        return WarmupTimeline(tuple(self.median_slot_ready_s()), self.loaded_bytes_per_s(latency_s, idle_link),
                              latency_s, self.median_forward_s(), idle_link)
