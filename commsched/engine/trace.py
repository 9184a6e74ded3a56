"""Timeline trace: a Chrome-trace JSON per rank (open in Perfetto or chrome://tracing).

Rows (``tid``) of one rank's process:

- ``compute``: the iteration, forward and backward per module, ``step``;
- ``gates``: time the forward pass (or the end of backward, or a synchronize)
  spent waiting for a reduction, or for the all-gather of sharded parameters
  (``gather``): communication that was *not* hidden;
- ``queue``: per partition, from its bucket being ready to its issue;
- ``wire``: per partition, from its issue to its completion (recorded by the
  completion callback, so the time is when it really finished);
- ``update``: per bucket, its optimizer update.

The tracer is an observer of the events the core emits (`commsched.engine.events`);
it is subscribed only when ``Strategy(trace_dir=...)`` is set.

[Note: writing a trace] `check_trace_dir` runs among ``prepare()``'s own
checks, so a directory one rank cannot write to stops every rank there, naming
it, instead of that rank alone failing later while the others wait for it.
The file is written to a temporary file of an unpredictable name, created
anew in the directory (``mkstemp``: never through a link planted there), then
renamed over the final name (a link planted there is replaced, not followed).
A write that fails later, mid-run (a full disk), is logged and training goes on:
the trace is not worth stopping every rank for.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from commsched.comm.transport import Handle
from commsched.engine.completion import CallbackTracker
from commsched.engine.events import Observer
from commsched.layout.grad_layout import GradLayout
from commsched.layout.partitions import Partition

ROWS = ("compute", "gates", "queue", "wire", "update")

logger = logging.getLogger("commsched")


def now_us() -> float:
    return time.perf_counter_ns() / 1e3


WRITE_EVERY = 20
"""Iterations between rewrites of the file, so a run that dies still leaves a trace."""


def check_trace_dir(directory: str | os.PathLike) -> None:
    """Create ``directory`` if needed and prove this process can write a trace there; else raise
    ``OSError`` naming it and the cause (see [Note: writing a trace])."""
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        descriptor, probe = tempfile.mkstemp(dir=directory, prefix=".commsched-probe-")
        os.close(descriptor)
        os.unlink(probe)
    except OSError as error:
        cause = f"{error.strerror}: {error.filename!r}" if error.strerror and error.filename else str(error)
        raise type(error)(
            error.errno,
            f"Strategy(trace_dir={os.fspath(directory)!r}): cannot write a trace there ({cause}). Give a "
            "directory this rank can create and write to, or trace_dir=None",
        ) from error


def _write_atomically(path: Path, text: str) -> None:
    """``path`` holds ``text`` at once or not at all, whatever link was planted at any name involved."""
    descriptor, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(descriptor, 0o666 & ~_UMASK)  # as a plain open() would create it (mkstemp's is 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(text)
        os.replace(partial, path)
    except BaseException:
        try:
            os.unlink(partial)
        except OSError:
            pass
        raise


def _umask() -> int:
    """The process's umask (read once, at import, when nothing else creates files)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _umask()


class Tracer(Observer):
    """Collects complete ("X") events for one rank and writes them as JSON."""

    def __init__(
        self,
        directory: str | os.PathLike,
        rank: int,
        root: torch.nn.Module,
        params: list[torch.nn.Parameter],
        tracker: CallbackTracker,
        completion_callbacks: Callable[[], bool] = lambda: True,
    ):
        """``completion_callbacks()``: whether a handle's completion callback runs when it is done
        (`commsched.comm.transport.Transport.completion_callbacks`); else a partition's wire span
        ends where the dispatcher finds it complete (`partition_completed`)."""
        self.path = Path(directory) / f"rank{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._failed_writes = 0
        self.rank = rank
        self.iteration = -1
        self._root = root
        self._tracker = tracker
        self._completion_callbacks = completion_callbacks
        self._issued: dict[int, tuple[str, float]] = {}
        """Per handle still on the wire, where completions have no callback: its span's name and start."""
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # completion callbacks run on communication threads
        self._open: dict[tuple[str, int], float] = {}
        self._written = -1
        self._ready_us: list[float] = []
        self._hooks = self._attach_modules(root, params)

    # ------------------------------------------------------------------ events
    def layout_built(self, layout: GradLayout, placement: str | None) -> None:
        self._ready_us = [0.0] * len(layout.buckets)
        if placement is not None:
            self.note("layout", summary=placement)

    def iteration_started(self, iteration: int) -> None:
        self.iteration = iteration
        if iteration % WRITE_EVERY == 0:
            self._write_or_warn()

    def forward_started(self) -> None:
        if torch.is_grad_enabled() and self._root.training:
            self.end("compute", 0, "iteration")
            self.begin("compute", 0)

    def gradient_ready(self, slot: int) -> None:
        owner = self._owner_of_slot.get(slot)
        if owner is not None:
            self.end("compute", -owner[0], f"backward {owner[1]}")

    def bucket_ready(self, bucket: int) -> None:
        self._ready_us[bucket] = now_us()

    def partition_issued(self, partition: Partition, handle: Handle) -> None:
        issued = now_us()
        name = f"P{partition.pid} b{partition.bucket}"
        self.span("queue", name, self._ready_us[partition.bucket], issued, bytes=partition.nbytes)
        if not self._completion_callbacks():
            self._issued[id(handle)] = (name, issued)
            return
        self._tracker.when_complete(handle, lambda: self.span(
            "wire", name, issued, now_us(), bytes=partition.nbytes, priority=partition.priority))

    def partition_completed(self, partition: Partition, handle: Handle) -> None:
        started = self._issued.pop(id(handle), None)
        if started is not None:
            name, issued = started
            self.span("wire", name, issued, now_us(), bytes=partition.nbytes, priority=partition.priority)

    def reduction_waited(self, bucket: int, start_s: float, end_s: float) -> None:
        self.span("gates", f"wait b{bucket}", start_s * 1e6, end_s * 1e6)

    def bucket_updated(self, bucket: int, start_s: float, end_s: float) -> None:
        self.span("update", f"update b{bucket}", start_s * 1e6, end_s * 1e6)

    def update_waited(self, bucket: int, start_s: float, end_s: float) -> None:
        self.span("gates", f"gather b{bucket}", start_s * 1e6, end_s * 1e6)

    def step_finished(self, start_s: float, end_s: float) -> None:
        self.span("compute", "step", start_s * 1e6, end_s * 1e6)

    def closed(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._write_or_warn()

    # ----------------------------------------------------------------- records

    def span(self, row: str, name: str, start_us: float, end_us: float, **args: Any) -> None:
        event = {"name": name, "ph": "X", "pid": self.rank, "tid": row, "ts": start_us,
                 "dur": max(end_us - start_us, 0.0), "args": {"iteration": self.iteration, **args}}
        with self._lock:
            self._events.append(event)

    def note(self, name: str, **args: Any) -> None:
        """An instant event: something worth reading next to the timeline (a plan, a layout)."""
        event = {"name": name, "ph": "i", "s": "p", "pid": self.rank, "tid": "compute", "ts": now_us(),
                 "args": {"iteration": self.iteration, **args}}
        with self._lock:
            self._events.append(event)

    def begin(self, row: str, key: int) -> None:
        self._open[(row, key)] = now_us()

    def end(self, row: str, key: int, name: str, **args: Any) -> None:
        start = self._open.pop((row, key), None)
        if start is not None:
            self.span(row, name, start, now_us(), **args)

    def _attach_modules(self, root: torch.nn.Module, params: list[torch.nn.Parameter]) -> list[RemovableHandle]:
        """Forward spans for every module; backward spans for modules owning parameters.

        A backward span opens when autograd starts the node that produced the
        module's output (a node pre-hook: no tensor is wrapped, so in-place
        operations stay legal) and closes when the module's first parameter
        gradient is ready (`gradient_ready`). Returns the hook handles.
        """
        slot_of = {id(p): slot for slot, p in enumerate(params)}
        self._owner_of_slot: dict[int, tuple[int, str]] = {}
        handles = []
        for name, module in root.named_modules():
            label = name or type(root).__name__
            key = id(module)
            owns = [slot_of[id(p)] for p in module._parameters.values() if p is not None and id(p) in slot_of]
            for slot in owns:
                self._owner_of_slot[slot] = (key, label)
            handles.append(module.register_forward_pre_hook(
                lambda m, a, key=key: self.begin("compute", key)))
            handles.append(module.register_forward_hook(
                lambda m, a, o, key=key, label=label, owns=bool(owns): self._after_forward(key, label, o, owns)))
        return handles

    def _after_forward(self, key: int, label: str, output: object, owns_parameters: bool) -> None:
        self.end("compute", key, f"forward {label}")
        node = getattr(output, "grad_fn", None)
        if owns_parameters and node is not None:
            node.register_prehook(lambda grad_outputs, key=key: self.begin("compute", -key))

    def _write_or_warn(self) -> None:
        """`write`; a failure is logged (the first one with its cause) and the run goes on."""
        try:
            self.write()
        except OSError:
            self._failed_writes += 1
            if self._failed_writes == 1:
                logger.warning("commsched: could not write the trace %s; training goes on, the trace will be "
                               "incomplete", self.path, exc_info=True)

    def write(self) -> Path:
        """Write every event so far; atomically, so a reader never sees half a file (see [Note: writing a
        trace])."""
        with self._lock:
            events = list(self._events)
        if len(events) == self._written:
            return self.path
        metadata = [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": row, "args": {"name": row}}
                    for row in ROWS]
        metadata.append({"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}})
        _write_atomically(self.path, json.dumps({"traceEvents": metadata + events, "displayTimeUnit": "ms"}))
        self._written = len(events)
        return self.path
