"""A killed parameter server or worker stops every other rank with an error naming it.

Real processes are killed with SIGKILL mid-training; no rank may hang. Each
surviving worker checks its own error and how long it took to come.
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.distributed_c10d import _get_default_store

import commsched
from commsched.testing import RanksFailed

pytestmark = pytest.mark.distributed

WORKERS, SERVERS = 2, 1
SERVER = WORKERS  # the last rank serves
TIMEOUT_S = 20.0
KILL_AT = 5
"""After the plan is agreed at iteration 3 (a collective among the workers)."""
BOUND_S = 15.0
"""A dead peer's sockets close at once: every rank must know well within the timeout."""


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _job_store() -> dist.TCPStore:
    """The job's TCPStore, unprefixed."""
    store = _get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def _signal_self_when_told(key: str, signum: int) -> None:
    # A client of its own: a blocking wait holds its client's connection, which
    # the process group also uses.
    shared = _job_store()
    store = dist.TCPStore(shared.host, shared.port, is_master=False, timeout=datetime.timedelta(seconds=300))
    store.wait([key])
    os.kill(os.getpid(), signum)


def train_until_a_peer_dies(
    rank: int, world_size: int, victim: int, signum: int = signal.SIGKILL, timeout_s: float = TIMEOUT_S,
    kill_at: int = KILL_AT, release: bool = False,
) -> str:
    """Train until ``victim`` gets ``signum`` as iteration ``kill_at`` starts; return this worker's error.

    ``release``: then release the model, as the exit handler would, and check that it ends there.
    """
    if rank == victim == SERVER:
        _job_store().set("server pid", str(os.getpid()))
        threading.Thread(target=_signal_self_when_told, args=("kill", signum), daemon=True).start()
    model, optimizer = _model_and_optimizer()
    strategy = commsched.Strategy(backend=commsched.ParameterServer(num_servers=SERVERS), timeout_s=timeout_s)
    if commsched.is_server_rank(SERVERS):
        commsched.serve(model, optimizer, strategy)
        raise AssertionError("the server finished cleanly although a worker died")
    model, optimizer = commsched.prepare(model, optimizer, strategy)
    generator = torch.Generator().manual_seed(rank)
    try:
        for iteration in range(1000):
            if iteration == kill_at:
                if rank == (0 if victim == SERVER else victim):  # the server is told, a worker kills itself
                    _job_store().set("kill", repr(time.time()))
                if rank == victim:
                    os.kill(os.getpid(), signum)
            x = torch.randn(8, 32, generator=generator)
            F.mse_loss(model(x), torch.zeros(8, 4)).backward()
            optimizer.step()
            optimizer.zero_grad()
    except commsched.CommunicationTimeout as error:
        # Measured from the order to kill: a worker may still wait for the pulls of the
        # iteration before (rank 0 is ahead of it) when the peer goes.
        store = _job_store()
        assert store.check(["kill"]), f"failed before any peer was killed: {error}"
        elapsed = time.time() - float(store.get("kill"))
        message = str(error)
        assert elapsed < BOUND_S, f"took {elapsed:.1f} s to notice: {message}"
        if release:
            # What exit runs too: telling a dead server this worker is done fails at once, and the
            # rest of the shutdown must run all the same.
            commsched.release(model)
            assert commsched.status(model).lifecycle is commsched.Lifecycle.RELEASED
        return message
    raise AssertionError("training went on although a peer was killed")


def server_loss_is_named(rank: int, world_size: int) -> str:
    message = train_until_a_peer_dies(rank, world_size, victim=SERVER, release=True)
    assert f"parameter server rank {SERVER}" in message, message
    return message


def worker_loss_is_named(rank: int, world_size: int) -> str:
    message = train_until_a_peer_dies(rank, world_size, victim=1)
    assert "worker rank 1 was lost" in message, message
    return message


def worker_loss_before_the_plan_is_named(rank: int, world_size: int) -> str:
    """Killed as iteration 3 starts, the worker leaves the others in the plan's collective."""
    message = train_until_a_peer_dies(rank, world_size, victim=1, kill_at=3)
    assert "plan" in message and "worker rank 1 closed its connection" in message, message
    return message


def hung_server_times_out(rank: int, world_size: int) -> str:
    """A stopped (not dead) server: its sockets stay open, so only the timeout can tell."""
    message = train_until_a_peer_dies(rank, world_size, victim=SERVER, signum=signal.SIGSTOP, timeout_s=3.0)
    assert f"parameter server rank {SERVER}" in message and "within 3 s" in message, message
    if rank == 0:
        os.kill(int(_job_store().get("server pid")), signal.SIGKILL)  # it would never report
    return message


def test_hung_server_gives_every_worker_a_timeout(ranks):
    with pytest.raises(RanksFailed) as failure:
        ranks(hung_server_times_out, WORKERS + SERVERS, timeout_s=120, collective_timeout_s=60)
    report = str(failure.value)
    assert "1 of 3 ranks failed" in report and f"----- rank {SERVER} -----" in report, report


def test_killed_server_is_named_by_every_worker(ranks):
    with pytest.raises(RanksFailed) as failure:
        ranks(server_loss_is_named, WORKERS + SERVERS, timeout_s=120, collective_timeout_s=60)
    report = str(failure.value)
    # Only the killed server failed: both workers' own checks passed, and both were released.
    assert "1 of 3 ranks failed" in report and f"----- rank {SERVER} -----" in report, report


def test_killed_worker_is_named_by_the_server_and_the_other_worker(ranks):
    with pytest.raises(RanksFailed) as failure:
        ranks(worker_loss_is_named, WORKERS + SERVERS, timeout_s=120, collective_timeout_s=60)
    report = str(failure.value)
    # The victim (rank 1) died, the server stopped with an error naming it, rank 0 passed its checks.
    assert "2 of 3 ranks failed" in report and "----- rank 0 -----" not in report, report
    assert "ParameterServerError" in report and "worker rank 1 was lost" in report, report


def test_worker_killed_before_the_plan_is_named_by_the_other_worker(ranks):
    with pytest.raises(RanksFailed) as failure:
        ranks(worker_loss_before_the_plan_is_named, WORKERS + SERVERS, timeout_s=120, collective_timeout_s=60)
    report = str(failure.value)
    # Rank 0 passed its checks (rank 1 died; the server, whose workers both left between
    # iterations, ended cleanly, which its rank function reports as a failure).
    assert "----- rank 0 -----" not in report and "----- rank 1 -----" in report, report
