"""Who serves and who trains, and the side channel that names a lost rank."""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch.distributed as dist

logger = logging.getLogger("commsched")


def server_ranks(world_size: int, num_servers: int) -> list[int]:
    """The ranks that serve: the last ``num_servers`` of the world.

    With torchrun, ranks are numbered node by node, so the last node(s) of
    ``--nnodes`` (the highest ``--node-rank``) hold the servers: start the
    server hosts with the highest node ranks and ``--nproc-per-node`` equal to
    the number of servers on each.
    """
    if not 1 <= num_servers < world_size:
        raise ValueError(
            f"Strategy(backend=ParameterServer(num_servers={num_servers})) needs at least one worker besides "
            f"the servers, but the world has {world_size} rank(s); launch at least "
            f"{num_servers + 1} processes or lower num_servers"
        )
    return list(range(world_size - num_servers, world_size))


def is_server_rank(num_servers: int, rank: int | None = None, world_size: int | None = None) -> bool:
    """Whether ``rank`` (default: this process) is a parameter server.

    Call it before building data loaders: on a server rank, ``prepare()``
    serves until the workers finish and then ends the process.
    """
    rank = dist.get_rank() if rank is None else rank
    world_size = dist.get_world_size() if world_size is None else world_size
    return rank in server_ranks(world_size, num_servers)


@dataclass(frozen=True)
class PSRoles:
    """This job's workers and servers (global ranks), and this process's place."""

    workers: list[int]
    servers: list[int]
    rank: int

    @classmethod
    def of_world(cls, num_servers: int) -> PSRoles:
        world_size = dist.get_world_size()
        servers = server_ranks(world_size, num_servers)
        return cls(list(range(world_size - num_servers)), servers, dist.get_rank())

    @property
    def is_server(self) -> bool:
        return self.rank in self.servers

    @property
    def server_index(self) -> int:
        return self.servers.index(self.rank)


class FailureBoard:
    """Notes in the job's key-value store, readable by every rank.

    A rank that sees a peer vanish writes who and when; every other rank, on its
    own communication error, reads the note to name the rank that was really
    lost (its own error only says which connection closed). A failure (a rank
    was lost) outranks a departure (a worker left between iterations, which is
    also how training ends when every worker exits without finishing).
    """

    KINDS = ("failure", "departure")

    def __init__(self, prefix: str):
        self._prefix = prefix
        self._store = _default_store()

    def report_failure(self, text: str) -> None:
        self._note("failure", text)

    def report_departure(self, text: str) -> None:
        self._note("departure", text)

    def failure(self) -> str | None:
        """The first failure noted, else the first departure, else None."""
        if self._store is None:
            return None
        try:
            for kind in self.KINDS:
                if self._store.check([self._key(kind)]):
                    return self._store.get(self._key(kind)).decode()
        except Exception:  # noqa: BLE001 - the store may be gone with the job
            return None
        return None

    def wait_for_failure(self, timeout_s: float) -> str | None:
        """`failure`, waiting up to ``timeout_s`` for a first note (None: none came)."""
        if self._store is None:
            return None
        try:
            self._store.wait([self._key("noted")], datetime.timedelta(seconds=timeout_s))
        except Exception:  # noqa: BLE001 - a timeout, or the store is gone with the job
            return None
        return self.failure()

    def _note(self, kind: str, text: str) -> None:
        if self._store is None:
            return
        try:
            if not self._store.check([self._key(kind)]):
                self._store.set(self._key(kind), text)
            self._store.set(self._key("noted"), kind)
        except Exception:  # noqa: BLE001 - the store may be gone with the job
            logger.debug("commsched: could not record a %s note", kind, exc_info=True)

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{name}"


def _default_store():
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 - no store: failure notes are best effort
        return None
