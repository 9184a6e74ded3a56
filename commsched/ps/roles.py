"""Who serves and who trains, and the side channel that names a lost rank."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from commsched.comm.heartbeat import job_store, store_clock

logger = logging.getLogger("commsched")

STORE_TIMEOUT_S = 10.0
"""Longest wait for one read or write of a failure note (the store may be gone with the job)."""

NOTE_POLL_S = 0.1
"""How often a rank waiting for a failure note reads the notes again."""

NOTE_CHARS = 2000
"""Longest note text kept: notes end up in error messages."""


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
    own communication error, reads the notes to name the rank that was really
    lost (its own error only says which connection closed). A worker that ends
    by an exception notes it itself (a crash). A crash outranks a failure (a
    rank was lost), which outranks a departure (a worker left between
    iterations, which is also how training ends when every worker exits without
    finishing); among notes of one kind the first written wins.

    Each rank writes only under keys of its own, and each note carries its
    writer, the iteration it was at and a tick of the store's clock: a note whose
    key and writer disagree, or one an earlier job left in the same store, is not
    believed (see [Note: keys of this job only] in `commsched.comm.heartbeat`).
    """

    KINDS = ("crash", "failure", "departure")
    """In the order they are believed."""

    def __init__(self, prefix: str, rank: int, ranks: Sequence[int], store: dist.Store | None = None):
        """``rank``: this process's; ``ranks``: the job's (the only writers believed); ``store``: the
        job's store under its prefix, a client of the board's own (None: a clone of the default store's)."""
        self._prefix, self._rank, self._ranks = prefix, rank, frozenset(ranks)
        self._store = job_store(STORE_TIMEOUT_S) if store is None else store
        self._joined = None
        if self._store is not None:
            try:
                self._joined = store_clock(self._store)
            except Exception:  # noqa: BLE001 - a store without counters: notes are best effort
                self._store = None

    def report_crash(self, text: str, iteration: int) -> None:
        self._note("crash", text, iteration)

    def report_failure(self, text: str, iteration: int) -> None:
        self._note("failure", text, iteration)

    def report_departure(self, text: str, iteration: int) -> None:
        self._note("departure", text, iteration)

    def failure(self) -> str | None:
        """The note believed first (see the class), as a sentence naming its writer, or None."""
        if self._store is None:
            return None
        try:
            noted = self._read(self._key("noted")) or ""
            slots = {tuple(entry.split("/")) for entry in noted.split(";") if entry.count("/") == 1}
            notes = [note for kind, writer in slots if kind in self.KINDS and writer.isdigit()
                     and (note := self.note_of(kind, int(writer))) is not None]
        except Exception:  # noqa: BLE001 - the store may be gone with the job
            return None
        if not notes:
            return None
        return min(notes, key=lambda note: (self.KINDS.index(note.kind), note.tick)).describe()

    def note_of(self, kind: str, writer: int) -> FailureNote | None:
        """``writer``'s note of ``kind`` in this job, if it wrote one and it is believed."""
        if self._store is None or writer not in self._ranks:
            return None
        try:
            text = self._read(self._key(kind, writer))
        except Exception:  # noqa: BLE001 - the store may be gone with the job
            return None
        note = FailureNote.parse(text) if text is not None else None
        if note is None or (note.kind, note.writer) != (kind, writer) or note.tick <= self._joined:
            return None
        return note

    def wait_for_failure(self, timeout_s: float) -> str | None:
        """`failure`, waiting up to ``timeout_s`` for a first note (None: none came)."""
        deadline = time.monotonic() + timeout_s
        while True:
            note = self.failure()
            if note is not None or self._store is None or time.monotonic() >= deadline:
                return note
            time.sleep(NOTE_POLL_S)

    def _note(self, kind: str, text: str, iteration: int) -> None:
        if self._store is None:
            return
        try:
            if self.note_of(kind, self._rank) is not None:
                return  # the first of its kind from this rank is the cause; later ones follow from it
            note = FailureNote(kind, self._rank, iteration, _one_line(text), store_clock(self._store))
            self._store.set(self._key(kind, self._rank), note.encode())
            self._store.append(self._key("noted"), f"{kind}/{self._rank};")
        except Exception:  # noqa: BLE001 - the store may be gone with the job
            logger.debug("commsched: could not record a %s note", kind, exc_info=True)

    def _read(self, key: str) -> str | None:
        return self._store.get(key).decode(errors="replace") if self._store.check([key]) else None

    def _key(self, name: str, writer: int | None = None) -> str:
        return f"{self._prefix}/{name}" if writer is None else f"{self._prefix}/{name}/{writer}"


@dataclass(frozen=True)
class FailureNote:
    """What one rank noted: the kind, who wrote it, at which iteration, what it saw, and when (a store tick)."""

    kind: str
    writer: int
    iteration: int
    text: str
    tick: int

    def encode(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def parse(cls, text: str) -> FailureNote | None:
        """The note ``text`` encodes, or None for anything else (a stray or damaged key)."""
        try:
            fields = json.loads(text)
        except ValueError:
            return None
        types = {"kind": str, "writer": int, "iteration": int, "text": str, "tick": int}
        if not isinstance(fields, dict) or fields.keys() != types.keys() or not all(
                type(fields[name]) is kind for name, kind in types.items()):
            return None
        return cls(**{**fields, "text": _one_line(fields["text"])})

    def describe(self) -> str:
        at = f"iteration {self.iteration}" if self.iteration >= 0 else "its first iteration"
        return f"{self.text} (noted by rank {self.writer} at {at})"


def _one_line(text: str) -> str:
    """``text`` as one printable line of at most `NOTE_CHARS` characters."""
    line = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return line if len(line) <= NOTE_CHARS else line[:NOTE_CHARS - 3] + "..."
