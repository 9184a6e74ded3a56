"""Parameter-server transport, worker side: push gradient blocks, pull new values.

Each partition the scheduler issues is one block of the sharding plan: the
worker copies the block's gradient (and a trailer: iteration, per-parameter
"has a gradient" flags) into a send buffer, posts the receive of the block's
new values into a staging copy of the bucket, and sends. The block's handle
completes when the new values have arrived, so the credit window covers the
whole round trip. The "update" of a bucket (`commsched.ps.remote_update`),
run where the all-reduce backend runs the optimizer (at a module's gate, or at
``step()`` without overlap), is the copy of the pulled values into the
parameters.

Receives complete through `commsched.ps.receive` (see [Note: one waiter per
receive] there).

[Note: a worker's failures] Every send and receive, posted or waited for,
that fails becomes a `CommunicationTimeout` naming the peer and quoting the
note a peer left (`commsched.ps.roles.FailureBoard`): gloo raises at once when
an operation is posted to a peer whose connection closed, not only when it is
waited for. At the end (`finish`), a worker that is ending by an exception says
so, in a note of its own and with a FAILED command instead of FINISH, so that
the servers and the other workers report a crash, not a worker that finished
early; and nothing there may raise, so that the rest of the shutdown runs.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Sequence
from typing import NoReturn

import torch
import torch.distributed as dist

from commsched.comm.transport import TransportStatus
from commsched.errors import CommunicationTimeout, communication_failed, communication_timeout, wait_work
from commsched.layout.buckets import Bucket, BucketSet
from commsched.layout.partitions import Partition
from commsched.ps.config import JobConfig
from commsched.ps.protocol import (
    HEADER_TAG,
    LAYOUT_TAG,
    PLAN_TAG,
    Command,
    make_header,
    pull_tag,
    push_tag,
    trailer_length,
)
from commsched.ps.receive import Completion, ReceiveWaiter
from commsched.ps.roles import FailureBoard, PSRoles
from commsched.ps.sharding import ShardingPlan, plan_model_sharding
from commsched.update.kinds import encode_hyperparameters, encoded_length, hyperparameter_snapshot, optimizer_kind

logger = logging.getLogger("commsched")

NOTE_WAIT_S = 5.0
"""How long a worker whose collective with the other workers failed waits for a
server's note naming the lost worker (servers see a connection close at once)."""


class _BlockHandle:
    """One block's push and pull; complete once the new values have arrived."""

    __slots__ = ("_backend", "_completion", "_block", "_server")

    def __init__(self, backend: ParameterServerTransport, completion: Completion, block: int, server: int):
        self._backend, self._completion = backend, completion
        self._block, self._server = block, server

    def wait(self, timeout_s: float) -> None:
        completion = self._completion
        if completion.done.wait(timeout_s) and completion.error is None:
            return
        self._backend.raise_lost(
            f"the pull of block {self._block} from parameter server rank {self._server}",
            completion.error, timeout_s,
        )

    def order(self) -> bool:
        """The pull completes on the host (a receive): the host waits."""
        return False

    def is_completed(self) -> bool:
        return self._completion.done.is_set()

    def on_complete(self, callback: Callable[[], None]) -> None:
        self._completion.add_callback(callback)


class ParameterServerTransport:
    """Pushes blocks to their servers and pulls the new values back."""

    is_local = False
    completion_callbacks = True
    sums_usage_flags = False
    scatter = None
    two_steps = None
    compression = None
    join_refusal = (
        "Join (uneven inputs) is not supported with Strategy(backend=ParameterServer(...)): in sync mode "
        "the servers wait for every worker's gradients. Give every worker the same number of batches "
        "(DistributedSampler(drop_last=True)), or use mode='async'."
    )

    def __init__(
        self,
        config: JobConfig,
        roles: PSRoles,
        group: dist.ProcessGroup,
        optimizer: torch.optim.Optimizer,
        params: Sequence[torch.nn.Parameter],
        board: FailureBoard,
    ):
        self.config = config
        self.roles = roles
        self.group = group
        """This job's own group of every rank, for its point-to-point traffic only, so that
        several parameter-server jobs (or other traffic) in one process never mix messages."""
        self.optimizer = optimizer
        self.kind = optimizer_kind(optimizer)
        self.params = list(params)
        self.board = board
        self.world_size = len(roles.workers)
        self.plan: ShardingPlan | None = None
        self.stages: list[Bucket] = []
        """Per bucket, a copy whose flat buffer receives the pulled values."""
        self._push_buffers: list[torch.Tensor] = []
        self._push_works: list[dist.Work | None] = []
        self._block_at: dict[tuple[int, int], int] = {}
        self._header_sends: list[tuple[dist.Work, str]] = []
        """Headers (and plans) in flight, each with what it is and to which server."""
        self._sent_hyperparameters: list[dict[str, object]] | None = None
        self._iteration = -1
        self._stepped = True
        """Whether ``step()`` ran after the latest synchronised backward pass began."""
        self._exception_at_start = _shown_exception()
        """An exception shown before this job began (an interactive session's) is not this job's end."""
        self._waiters = {rank: ReceiveWaiter(rank, config.timeout_s) for rank in roles.servers}
        self.finished = False

    # ----------------------------------------------------------------- layout
    def attach(self, bucket_set: BucketSet, partition_bytes: int | None) -> list[Partition]:
        """Tell the servers the layout (rank 0), plan the blocks, allocate the buffers.

        The blocks are the job's (`JobConfig.block_bytes`): the servers
        derive the same ones, so ``partition_bytes`` is not used."""
        if self.roles.rank == self.roles.workers[0]:
            order = torch.tensor(list(bucket_set.forward_order), dtype=torch.int64)
            for server in self.roles.servers:
                self.send(order, server, LAYOUT_TAG, "the layout")
        self.plan = plan_model_sharding(
            self.params, bucket_set.bucket_slots, bucket_set.priorities, self.config.block_bytes,
            len(self.roles.servers),
        )
        buckets = bucket_set.buckets
        self.stages = [Bucket(bucket.index, bucket.params) for bucket in buckets]
        self._push_buffers = [
            torch.empty(block.end - block.start + trailer_length(len(segments)), dtype=buckets[block.bucket].dtype)
            for block, segments in zip(self.plan.blocks, self.plan.segments, strict=True)
        ]
        self._push_works = [None] * len(self.plan.blocks)
        self._block_at = {(block.bucket, block.start): block.pid for block in self.plan.blocks}
        if self.roles.rank == self.roles.workers[0]:
            logger.info("commsched: parameter-server sharding: %s", self.plan.summary(self.roles.servers))
        return list(self.plan.blocks)

    def describe(self) -> TransportStatus:
        servers = len(self.roles.servers)
        description = (f"parameter servers ({self.config.mode}): {self.world_size} workers, {servers} "
                       f"server{'s' if servers > 1 else ''} (ranks {', '.join(map(str, self.roles.servers))})")
        if self.plan is None:
            return TransportStatus(description)
        placement = "; ".join(
            f"block {b.pid} (bucket {b.bucket}, elements {b.start}:{b.end}, {b.nbytes} bytes) on rank "
            f"{self.roles.servers[server]}" for b, server in zip(self.plan.blocks, self.plan.servers)
        )
        return TransportStatus(description, f"{self.plan.summary(self.roles.servers)}. {placement}",
                               tuple(self.plan.loads_bytes()))

    # -------------------------------------------------------------- iteration
    def bucket_ready(self, bucket: Bucket) -> None:
        """Workers push their own gradients: the servers sum and divide."""

    def begin_iteration(self, iteration: int, new_plan: Sequence[int] | None) -> None:
        """Send every server this iteration's header (and the new plan, when it changes)."""
        self._wait_for_headers()
        self._iteration = iteration
        self._stepped = False
        self._sent_hyperparameters = hyperparameter_snapshot(self.optimizer, self.kind)
        header = make_header(Command.PUSH, iteration, new_plan is not None,
                             encode_hyperparameters(self.kind, self._sent_hyperparameters))
        sends = []
        for server in self.roles.servers:
            to = f"to parameter server rank {server}"
            what = f"the header of iteration {iteration} {to}"
            sends.append((self._post(lambda: dist.isend(header, dst=server, tag=HEADER_TAG, group=self.group),
                                     what), what))
            if new_plan is not None:
                plan = torch.tensor(list(new_plan), dtype=torch.int64)
                sends.append((self._post(lambda: dist.isend(plan, dst=server, tag=PLAN_TAG, group=self.group),
                                         f"the plan {to}"), f"the plan {to}"))
        self._header_sends = sends

    def check_hyperparameters_unchanged(self) -> None:
        """At ``step()``: the servers used the hyper-parameters read when backward began."""
        self._stepped = True
        if self._sent_hyperparameters is None:
            return
        now = hyperparameter_snapshot(self.optimizer, self.kind)
        if now != self._sent_hyperparameters:
            raise RuntimeError(
                "the optimizer's hyper-parameters changed between backward() and step(); with "
                "Strategy(backend=ParameterServer(...)) the servers apply the update with the values read when "
                f"backward() began ({self._sent_hyperparameters}), not {now}. Change learning rates "
                "(or step LR schedulers) after step() or before backward()."
            )

    def launch(self, partition: Partition, bucket: Bucket, has_grad: Sequence[bool]) -> _BlockHandle:
        pid = self._block_at[(bucket.index, partition.start)]
        block, segments = self.plan.blocks[pid], self.plan.segments[pid]
        server = self.roles.servers[self.plan.servers[pid]]
        numel = block.end - block.start
        previous = self._push_works[pid]
        if previous is not None:  # long done: its pull has completed
            self._wait_all([previous], f"the push of block {pid} to parameter server rank {server}")
        buffer = self._push_buffers[pid]
        buffer[:numel].copy_(bucket.flat[block.start:block.end])
        buffer[numel] = self._iteration
        buffer[numel + 1:] = torch.tensor([has_grad[s.slot] for s in segments], dtype=buffer.dtype)
        values = self.stages[bucket.index].flat[block.start:block.end]
        receive = self._post(lambda: dist.irecv(values, src=server, tag=pull_tag(pid), group=self.group),
                             f"the pull of block {pid} from parameter server rank {server}")
        self._push_works[pid] = self._post(
            lambda: dist.isend(buffer, dst=server, tag=push_tag(pid), group=self.group),
            f"the push of block {pid} to parameter server rank {server}")
        return _BlockHandle(self, self._waiters[server].watch(receive), pid, server)

    def finish(self) -> None:
        """Tell the servers this worker is done, or failed (idempotent; also run at exit; never raises).

        See [Note: a worker's failures]."""
        if self.finished:
            return
        self.finished = True
        error = _uncaught_exception()
        failed = error is not None and error is not self._exception_at_start
        if failed and not communication_failed():  # else the cause is another rank's, noted or seen there
            self.board.report_crash(f"worker rank {self.roles.rank} failed with an exception "
                                    f"{self._when()}: {type(error).__name__}: {error}", self._iteration)
        if self.plan is not None and dist.is_initialized():
            command = Command.FAILED if failed else Command.FINISH
            for server in self.roles.servers:
                try:
                    self.send_command(server, command)
                except Exception:  # noqa: BLE001 - the server may be gone: the shutdown goes on
                    logger.warning("commsched: could not tell parameter server rank %d that rank %d %s", server,
                                   self.roles.rank, "failed" if failed else "finished", exc_info=True)
        for waiter in self._waiters.values():
            waiter.stop(timeout_s=min(self.config.timeout_s, 30.0))

    def _when(self) -> str:
        if self._iteration < 0:
            return "before its first iteration"
        return f"after iteration {self._iteration}" if self._stepped else f"during iteration {self._iteration}"

    def explain_failure(self, error: CommunicationTimeout) -> None:
        """Name the lost rank if a peer notes it soon (a server sees a worker vanish at once)."""
        note = self.board.wait_for_failure(min(self.config.timeout_s, NOTE_WAIT_S))
        if note:
            raise CommunicationTimeout(f"{error} A peer reported: {note}.") from error

    def forget_process_groups(self) -> None:
        self.group = None  # type: ignore[assignment]
        # The last pushes and headers, done by now, hold the group's gloo context (and its device's
        # loop thread) for as long as they are referenced.
        self._push_works = [None] * len(self._push_works)
        self._header_sends = []

    # ---------------------------------------------------------------- messages
    def send_command(self, server: int, command: Command) -> None:
        """A header carrying ``command`` (between iterations) to ``server``."""
        self._wait_for_headers()
        padding = [0.0] * encoded_length(self.kind, len(self.optimizer.param_groups))
        header = make_header(command, self._iteration, False, padding)
        self.send(header, server, HEADER_TAG, f"a {command.name} command")

    def send(self, tensor: torch.Tensor, server: int, tag: int, what: str) -> None:
        what = f"sending {what} to parameter server rank {server}"
        self._wait_all([self._post(lambda: dist.isend(tensor, dst=server, tag=tag, group=self.group), what)], what)

    def receive(self, tensor: torch.Tensor, server: int, tag: int, what: str) -> None:
        what = f"receiving {what} from parameter server rank {server}"
        self._wait_all([self._post(lambda: dist.irecv(tensor, src=server, tag=tag, group=self.group), what)], what)

    def _post(self, start: Callable[[], dist.Work], what: str) -> dist.Work:
        """Post an operation; one refused at once (its peer's connection closed) fails like a wait."""
        try:
            return start()
        except RuntimeError as error:
            self.raise_lost(what, error, self.config.timeout_s)

    def _wait_for_headers(self) -> None:
        for work, what in self._header_sends:
            self._wait_all([work], what)
        self._header_sends = []

    def _wait_all(self, works: Sequence[dist.Work], what: str) -> None:
        for work in works:
            try:
                wait_work(work, self.config.timeout_s)
            except RuntimeError as error:
                self.raise_lost(what, error, self.config.timeout_s)

    def raise_lost(self, what: str, error: BaseException | None, timeout_s: float) -> NoReturn:
        """Raise `CommunicationTimeout` naming the rank that was lost, if a peer noted it."""
        note = self.board.failure()
        cause = f"a peer reported: {note}" if note else (
            "the parameter server (or, through it, another worker) probably died, raised an error, or is "
            "stopped or slower than Strategy.timeout_s; check its log"
        )
        raise communication_timeout(what, timeout_s, error, who=f"worker rank {self.roles.rank}",
                                    cause=cause) from error


def _uncaught_exception() -> BaseException | None:
    """The exception this process is ending by, if the interpreter is exiting after an uncaught one.

    At exit (`threading`'s shutdown has stopped the main thread) Python keeps
    the exception it just printed as ``sys.last_exc`` (``sys.last_value``
    before 3.12).
    """
    return None if threading.main_thread().is_alive() else _shown_exception()


def _shown_exception() -> BaseException | None:
    """The latest exception the interpreter printed as uncaught (an interactive session's, or the one ending it)."""
    return getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
