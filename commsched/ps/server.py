"""The parameter server: receive blocks, apply the optimizer, answer with new values.

A server rank holds, for each block placed on it, the block's values, its
optimizer state (a private optimizer of the user's class over the block's
segments, with the hyper-parameters the workers send each iteration) and one
receive buffer per worker. One thread per worker receives that worker's
messages in the order the worker sends them (see `commsched.ps.protocol`) and
reports each to the main thread through a queue; the main thread applies
updates and sends the new values:

* ``sync``: when every worker's gradient of a block has arrived, sum them in
  worker order, divide by the number of workers, update, send to all;
* ``async``: apply each worker's gradient (divided by the number of workers)
  as it arrives, and send the newest values back to that worker. Staleness (how
  many other updates of the block landed between a worker's pull and its next
  push) is counted and reported. With ``Strategy.ps_max_staleness`` = K, a
  worker more than K iterations (by the headers received) ahead of the slowest
  worker still training gets its values only once that worker catches up.

[Note: finished or lost] A worker normally ends with a FINISH message, or,
ending by an exception, with a FAILED message (and a note of its own saying
which): the server stops at once with an error naming it. One
whose connection closes mid-iteration (between its header and its last push)
is lost: the server stops at once with an error naming it, which every other
rank then reads (see `commsched.ps.roles.FailureBoard`). One whose connection
closes between iterations may have ended cleanly (``destroy_process_group()``
before exit) or crashed: it counts as finished after the iterations it
completed, so in ``sync`` mode another worker beginning a later iteration
stops the server with an error naming it, while the end of training (every
worker gone) is clean. ``async`` training goes on without it (logged).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from typing import NoReturn

import torch
import torch.distributed as dist

from commsched.comm.side_groups import destroy_own_groups
from commsched.errors import wait_work
from commsched.layout.buckets import bucket_layout
from commsched.layout.partitions import fifo_plan
from commsched.ps.checkpoints import CheckpointExchange
from commsched.ps.config import JobConfig
from commsched.ps.protocol import (
    HEADER_TAG,
    LAYOUT_TAG,
    PLAN_TAG,
    Command,
    header_length,
    pull_tag,
    push_tag,
    trailer_length,
)
from commsched.ps.report import ParameterServerError, ServerReport
from commsched.ps.roles import FailureBoard, PSRoles
from commsched.ps.sharding import ShardingPlan, plan_model_sharding
from commsched.update.fused import BucketUpdater
from commsched.update.kinds import decode_hyperparameters, encoded_length, optimizer_kind, user_class

logger = logging.getLogger("commsched")

THREAD_JOIN_S = 10.0


class ParameterServer:
    """Serves one rank's share of the blocks until every worker has finished."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: JobConfig,
        roles: PSRoles,
        group: dist.ProcessGroup,
        board: FailureBoard,
    ):
        self.config = config
        self.roles = roles
        self.group = group
        self.board = board
        self.optimizer = optimizer
        self.kind = optimizer_kind(optimizer)
        self.params = [p for _, p in model.named_parameters() if p.requires_grad]
        self.num_workers = len(roles.workers)
        self.num_groups = len(optimizer.param_groups)
        self._header_length = header_length(encoded_length(self.kind, self.num_groups))
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._timeout = config.timeout_s
        self.mode = config.mode
        self._max_lead = math.inf if config.max_staleness is None else config.max_staleness

    # ------------------------------------------------------------------ setup
    def _build(self, forward_order: list[int]) -> None:
        bucket_slots, priorities = bucket_layout(self.params, forward_order, self.config.bucket_size_limits_bytes)
        self.plan: ShardingPlan = plan_model_sharding(
            self.params, bucket_slots, priorities, self.config.block_bytes, len(self.roles.servers)
        )
        self.mine = self.plan.blocks_of(self.roles.server_index)
        self._local = {pid: i for i, pid in enumerate(self.mine)}
        self._initial_order = [pid for pid in fifo_plan(self.plan.blocks) if pid in self._local]
        dtype_of = {pid: self.params[self.plan.segments[pid][0].slot].dtype for pid in self.mine}
        with torch.no_grad():
            self.values = {
                pid: torch.cat([self.params[s.slot].detach().reshape(-1)[s.param_start:s.param_start + s.numel]
                                for s in self.plan.segments[pid]]).clone()
                for pid in self.mine
            }
        self.grads = {pid: torch.zeros_like(self.values[pid]) for pid in self.mine}
        self.received = {
            pid: [torch.zeros(self.values[pid].numel() + trailer_length(len(self.plan.segments[pid])),
                              dtype=dtype_of[pid]) for _ in range(self.num_workers)]
            for pid in self.mine
        }
        self._segment_views = {
            pid: [self.values[pid][s.block_start:s.block_start + s.numel] for s in self.plan.segments[pid]]
            for pid in self.mine
        }
        self._server_optimizer = self._make_server_optimizer()
        self._checkpoints = CheckpointExchange(
            self.kind, {pid: self.plan.segments[pid] for pid in self.mine}, self.values, self._segment_views,
            self._server_optimizer, self._lock, self.group, self._timeout,
        )
        self.updater = BucketUpdater(
            self._server_optimizer,
            [self._segment_views[pid] for pid in self.mine],
            [[self.grads[pid][s.block_start:s.block_start + s.numel] for s in self.plan.segments[pid]]
             for pid in self.mine],
            [[s.slot for s in self.plan.segments[pid]] for pid in self.mine],
            fused=self.config.fuse_optimizer,
        )
        self._pull_sends: dict[int, list[tuple[dist.Work, torch.Tensor, int]]] = {pid: [] for pid in self.mine}
        self._arrived = {pid: 0 for pid in self.mine}
        self._version = {pid: 0 for pid in self.mine}
        self._pulled_version = {pid: [0] * self.num_workers for pid in self.mine}
        self._hyperparameters: list[list[dict] | None] = [None] * self.num_workers
        self._header_iteration = [-1] * self.num_workers
        self._finished: dict[int, int] = {}
        self._held: dict[int, list[int]] = {w: [] for w in range(self.num_workers)}
        """Async with a staleness bound: per worker, blocks whose new values wait for slower workers."""

    def _make_server_optimizer(self) -> torch.optim.Optimizer:
        """The user's optimizer class over this server's segments, group by group."""
        group_of = {id(p): g for g, group in enumerate(self.optimizer.param_groups) for p in group["params"]}
        groups = [{k: v for k, v in group.items() if k != "params"} | {"params": []}
                  for group in self.optimizer.param_groups]
        for pid in self.mine:
            for segment, view in zip(self.plan.segments[pid], self._segment_views[pid], strict=True):
                group = group_of.get(id(self.params[segment.slot]))
                if group is not None:
                    groups[group]["params"].append(view)
        return user_class(self.optimizer)(groups)

    # ------------------------------------------------------------------ serve
    def serve(self) -> ServerReport:
        """Receive the layout, then serve until every worker has finished."""
        order = torch.empty(len(self.params), dtype=torch.int64)
        first = self.roles.workers[0]
        try:
            self._wait(dist.irecv(order, src=first, tag=LAYOUT_TAG, group=self.group), None)
        except RuntimeError as error:
            self._fail(f"worker rank {first} was lost before it sent the layout to parameter server rank "
                       f"{self.roles.rank}: {error}")
        self._build(order.tolist())
        report = ServerReport(self.roles.rank, len(self.mine), sum(self.plan.blocks[p].nbytes for p in self.mine))
        self.report = report
        logger.info("commsched: parameter server rank %d serves %d blocks (%s)", self.roles.rank,
                    len(self.mine), self.plan.summary(self.roles.servers))
        threads = [threading.Thread(target=self._receive_from, args=(w,), daemon=True,
                                    name=f"commsched-ps-recv-{worker}")
                   for w, worker in enumerate(self.roles.workers)]
        for thread in threads:
            thread.start()
        finished = self._finished
        self._how_finished: dict[int, str] = {}
        while len(finished) < self.num_workers:
            event = self._events.get()
            kind, w = event[0], event[1]  # w: the worker's index among the workers
            if kind == "push":
                self._on_push(w, event[2])
            elif kind == "header":
                self._on_header(w, event[2], event[3], finished)
            elif kind == "finish":
                self._on_finish(w, finished, "finished")
            elif kind == "gone":
                self._on_gone(w, event[2], finished)
            elif kind == "failed":
                self._on_failed(w)
            elif kind == "lost":
                self._fail(f"worker rank {self.roles.workers[w]} was lost by parameter server rank "
                           f"{self.roles.rank} during iteration {self._header_iteration[w]}: {event[2]}",
                           self._header_iteration[w])
        for thread in threads:
            thread.join(timeout=THREAD_JOIN_S)
        for sends in self._pull_sends.values():
            for work, _, _ in sends:
                self._wait(work, self._timeout, quiet=True)
        logger.info("commsched: %s", report.describe())
        destroy_own_groups([self.group])  # see [Note: groups a model made for itself]
        self.group = self._checkpoints = None  # type: ignore[assignment]  # see [Note: process groups at exit]
        return report

    def _receive_from(self, w: int) -> None:
        """One worker's messages, in order; runs on its own thread."""
        worker = self.roles.workers[w]
        order = self._initial_order
        between_iterations = True
        try:
            while True:
                header = torch.empty(self._header_length, dtype=torch.float64)
                between_iterations = True
                self._wait(dist.irecv(header, src=worker, tag=HEADER_TAG, group=self.group), None)
                between_iterations = False
                command, iteration = Command(int(header[0])), int(header[1])
                if command is Command.PUSH:
                    if header[2]:
                        plan = torch.empty(len(self.plan.blocks), dtype=torch.int64)
                        self._wait(dist.irecv(plan, src=worker, tag=PLAN_TAG, group=self.group), self._timeout)
                        order = [pid for pid in plan.tolist() if pid in self._local]
                    receives = [
                        (pid, dist.irecv(self.received[pid][w], src=worker, tag=push_tag(pid), group=self.group))
                        for pid in order
                    ]
                    hyperparameters = decode_hyperparameters(self.kind, header[3:].tolist(), self.num_groups)
                    self._events.put(("header", w, iteration, hyperparameters))
                    for pid, work in receives:
                        self._wait(work, self._timeout)
                        self._events.put(("push", w, pid))
                elif command is Command.FINISH:
                    self._events.put(("finish", w))
                    return
                elif command is Command.FAILED:
                    self._events.put(("failed", w))
                    return
                elif command is Command.GET_STATE:
                    self._checkpoints.send_state(worker)
                elif command is Command.SET_STATE:
                    self._checkpoints.receive_state(worker)
                elif command is Command.SET_PARAMETERS:
                    self._checkpoints.receive_parameters(worker)
        except BaseException as error:  # noqa: BLE001 - reported to the main thread
            self._events.put(("gone" if between_iterations else "lost", w, error))

    # ----------------------------------------------------------------- events
    def _on_header(self, w: int, iteration: int, hyperparameters: list[dict], finished: dict[int, int]) -> None:
        self._hyperparameters[w] = hyperparameters
        self._header_iteration[w] = iteration
        self.report.iterations = max(self.report.iterations, iteration + 1)
        self._check_even(finished)
        self._release_held()

    def _check_even(self, finished: dict[int, int]) -> None:
        """In sync mode, no worker may begin an iteration that a finished worker will never push."""
        if self.mode != "sync":
            return
        for done, count in finished.items():
            for w in range(self.num_workers):
                if w not in finished and self._header_iteration[w] >= count:
                    began = f"worker rank {self.roles.workers[w]} began iteration {self._header_iteration[w] + 1}"
                    self._fail_uneven(done, count, began)

    def _fail_uneven(self, w: int, count: int, meanwhile: str) -> None:
        worker, how = self.roles.workers[w], self._how_finished[w]
        if how == "finished":
            # [Note: a worker that ends early] A process cannot read its own exit status at
            # exit, so one that caught an error and called sys.exit(1) says FINISH as one
            # that ran out of batches does: the message names both, and the cure of each.
            self._fail(
                f"worker rank {worker} ended after {count} synchronised iterations without an uncaught error, "
                f"while {meanwhile}: it ran out of batches, or it stopped on an error it caught (sys.exit() "
                f"in an except clause, say); rank {worker}'s log tells which. With ParameterServer(mode='sync') "
                "every worker runs the same number of iterations: give every rank the same number of batches "
                "(DistributedSampler(drop_last=True)), or, after an error, let it end the script uncaught "
                "so that the servers are told of the failure"
            )
        self._fail(
            f"worker rank {worker} was lost: its connection to parameter server rank {self.roles.rank} "
            f"closed after {count} iterations without finishing ({how}), while {meanwhile}"
        )

    def _on_finish(self, w: int, finished: dict[int, int], how: str) -> None:
        finished[w] = self._header_iteration[w] + 1
        self._how_finished[w] = how
        if self.mode == "sync" and any(self._arrived.values()):
            self._fail_uneven(w, finished[w], "other workers' gradients of the next iteration had arrived")
        self._check_even(finished)
        self._release_held()

    def _on_gone(self, w: int, error: BaseException, finished: dict[int, int]) -> None:
        """Its connection closed between iterations; see [Note: finished or lost]."""
        last = self._header_iteration[w]
        when = f"after iteration {last}" if last >= 0 else "before its first iteration"
        text = (f"worker rank {self.roles.workers[w]} closed its connection to parameter server rank "
                f"{self.roles.rank} {when} without finishing ({error})")
        logger.warning(
            "commsched: %s: %s", text,
            "training goes on without it" if self.mode == "async" else
            "the end of training if every worker does the same, an error if another goes on",
        )
        self.board.report_departure(text, last)  # read only by a worker whose own communication fails
        self._on_finish(w, finished, str(error))

    def _on_failed(self, w: int) -> None:
        """The worker is ending by an exception: a crash, whatever the mode (see [Note: finished or lost])."""
        worker = self.roles.workers[w]
        note = self.board.note_of("crash", worker)
        cause = note.text if note is not None else f"worker rank {worker} failed with an error (see its log)"
        self._fail(f"{cause}; parameter server rank {self.roles.rank} stops", self._header_iteration[w])

    def _fail(self, text: str, iteration: int | None = None) -> NoReturn:
        """Stop serving: note ``text`` for the other ranks (at ``iteration``; None: the latest any worker
        began) and raise it."""
        if iteration is None:
            iteration = max(getattr(self, "_header_iteration", [-1]))
        self.board.report_failure(text, iteration)
        raise ParameterServerError(text)

    def _on_push(self, w: int, pid: int) -> None:
        if self.mode == "async":
            self._update_async(pid, w)
            return
        self._arrived[pid] += 1
        if self._arrived[pid] == self.num_workers:
            self._arrived[pid] = 0
            self._update_sync(pid)

    # ---------------------------------------------------------------- updates
    def _check_trailer(self, pid: int, w: int, message: torch.Tensor, numel: int) -> None:
        if int(message[numel]) != self._header_iteration[w]:
            self._fail(f"block {pid} from worker rank {self.roles.workers[w]} belongs to iteration "
                       f"{int(message[numel])}, expected {self._header_iteration[w]}: the workers and "
                       "servers disagree on the protocol (different commsched versions?)")

    def _update_sync(self, pid: int) -> None:
        numel = self.values[pid].numel()
        messages = self.received[pid]
        grad = self.grads[pid]
        grad.copy_(messages[0][:numel])
        for message in messages[1:]:
            grad.add_(message[:numel])
        grad.div_(self.num_workers)
        used = messages[0][numel + 1:].clone()
        for w, message in enumerate(messages):
            self._check_trailer(pid, w, message, numel)
            if w:
                used.add_(message[numel + 1:])
        hyperparameters = self._hyperparameters[0]
        for w in range(1, self.num_workers):
            if self._hyperparameters[w] != hyperparameters:
                self._fail(
                    f"workers disagree on the optimizer's hyper-parameters: worker rank {self.roles.workers[0]} "
                    f"sent {hyperparameters}, worker rank {self.roles.workers[w]} sent {self._hyperparameters[w]}; "
                    "every worker must set the same learning rate (and other settings) each iteration"
                )
        skip = self._skipped(pid, used)
        self._wait_pull_sends(pid)
        with self._lock:
            self.updater.update(self._local[pid], hyperparameters, skip)
        self.report.updates += 1
        self._pull_sends[pid] = [
            (self._send_values(pid, self.values[pid], worker), self.values[pid], worker)
            for worker in self.roles.workers
        ]

    def _update_async(self, pid: int, w: int) -> None:
        numel = self.values[pid].numel()
        message = self.received[pid][w]
        self._check_trailer(pid, w, message, numel)
        torch.div(message[:numel], self.num_workers, out=self.grads[pid])
        skip = self._skipped(pid, message[numel + 1:])
        self.report.staleness.append(self._version[pid] - self._pulled_version[pid][w])
        with self._lock:
            self.updater.update(self._local[pid], self._hyperparameters[w], skip)
        self._version[pid] += 1
        self.report.updates += 1
        if self._lead(w) > self._max_lead:
            self._held[w].append(pid)
        else:
            self._send_newest(pid, w)

    def _lead(self, w: int) -> int:
        """Iterations worker ``w`` is ahead of the slowest worker still training."""
        others = [self._header_iteration[v] for v in range(self.num_workers) if v != w and v not in self._finished]
        return max(0, self._header_iteration[w] - min(others)) if others else 0

    def _release_held(self) -> None:
        """Send the values held back from workers that are no longer too far ahead."""
        for w, pids in self._held.items():
            if pids and self._lead(w) <= self._max_lead:
                self._held[w] = []
                for pid in pids:
                    self._send_newest(pid, w)

    def _send_newest(self, pid: int, w: int) -> None:
        """Async: send worker ``w`` block ``pid``'s current values (its pull)."""
        with self._lock:
            values = self.values[pid].clone()
        self._pulled_version[pid][w] = self._version[pid]
        self.report.max_lead = max(self.report.max_lead, self._lead(w))
        worker = self.roles.workers[w]
        kept = []
        for work, tensor, destination in self._pull_sends[pid]:
            if destination == worker:  # long done: the worker has pushed again since
                self._wait_sent(work, pid, destination)
            else:
                kept.append((work, tensor, destination))
        kept.append((self._send_values(pid, values, worker), values, worker))
        self._pull_sends[pid] = kept

    def _skipped(self, pid: int, used: torch.Tensor) -> frozenset[int]:
        flags = used.tolist()
        return frozenset(s.slot for s, flag in zip(self.plan.segments[pid], flags, strict=True) if flag == 0)

    def _wait_pull_sends(self, pid: int) -> None:
        for work, _, worker in self._pull_sends[pid]:
            self._wait_sent(work, pid, worker)
        self._pull_sends[pid] = []

    def _send_values(self, pid: int, values: torch.Tensor, worker: int) -> dist.Work:
        """Send ``worker`` block ``pid``'s new ``values`` (its pull); a closed connection stops the server."""
        try:
            return dist.isend(values, dst=worker, tag=pull_tag(pid), group=self.group)
        except RuntimeError as error:
            self._lost_receiver(pid, worker, error)

    def _wait_sent(self, work: dist.Work, pid: int, worker: int) -> None:
        try:
            self._wait(work, self._timeout)
        except RuntimeError as error:
            self._lost_receiver(pid, worker, error)

    def _lost_receiver(self, pid: int, worker: int, error: RuntimeError) -> NoReturn:
        w = self.roles.workers.index(worker)
        self._fail(f"worker rank {worker} was lost: parameter server rank {self.roles.rank} could not send it "
                   f"the values of block {pid} of iteration {self._header_iteration[w]} ({error})",
                   self._header_iteration[w])

    @staticmethod
    def _wait(work: dist.Work, timeout_s: float | None, quiet: bool = False) -> None:
        """Wait (None: the process group's timeout); ``quiet``: a failure is no error (the end)."""
        try:
            wait_work(work, timeout_s)
        except RuntimeError:
            if not quiet:
                raise
