"""Every rank beats into the job's store, so that a survivor of a failed collective can name the lost rank.

[Note: naming the lost rank] A gloo collective that fails says only that it
timed out, or which socket closed, not which rank is gone. So every rank of a
multi-rank group beats: a thread of its own writes a counter, and the iteration
this rank last began, into the job's key-value store every `BEAT_PERIOD_S` (a
write needs no answer, so a beat never blocks, even cut off from the network).
After a failed reduction, a survivor reads every peer's beat over `SILENCE_S`:
a rank whose counter did not move is dead, stopped, or cut off; one that beats
but has not begun this rank's iteration is busy elsewhere; the error names
them. Nothing runs per iteration; a failure costs `SILENCE_S` more. A rank
that gets a communication error of its own leaves a note of what it waited for
(`Heartbeat.note_failure`), which the others quote: two ranks waiting in
different collectives (one in ``optimizer.state_dict()``, the other at the
next backward pass) each learn where the other one was.

[Note: store clients are reused] Each new client of the job's store is a
connection to the store's server, which now and then stalls a new connection
for about 5 s: after a dozen or so have closed, or a hundred opened (torch
2.13's TCPStore, measured on loopback). A process that prepares many models (a
sweep, a test suite) would pay that every few prepare() calls. So the clients
are kept per job's store (`_StoreClients`): one that only serves to clone more
(for a survivor's watch) is shared by every heartbeat, and a heartbeat that
stops gives its own back for the next one to take.

[Note: keys of this job only] The store may outlive a job (torchrun's agent
hosts it across restarts) and be shared with other users of it. So every key
lives under the job's prefix (the one torch gives the default group's store,
through a clone of that store), and a mark a rank leaves for the others (its
failure) carries a tick of a counter in the store (`store_clock`): a reader
believes only marks written after it joined, never one an earlier job left.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import socket
import threading
import time
import weakref
from collections.abc import Sequence

import torch.distributed as dist

from commsched.errors import on_communication_failure

BEAT_PERIOD_S = 0.5
"""How often every rank writes its heartbeat."""


SILENCE_S = 2.5
"""How long a survivor watches its peers' heartbeats before naming those that did not beat."""


STORE_REACH_S = 3.0
"""How long a survivor tries to reach the job's store before concluding it cannot."""


BEAT_WRITE_S = 30.0
"""How long one beat may wait for the store before the beat thread gives up."""


logger = logging.getLogger("commsched")

_KEY = "commsched/heartbeat/{}"


_FAILED_KEY = "commsched/failed/{}"


_CLOCK_KEY = "commsched/clock"


def job_store(timeout_s: float) -> dist.Store | None:
    """A client of the job's store of its own, under the job's prefix; None without one.

    A clone of the default group's store (a ``PrefixStore`` over the job's
    TCPStore): the process group's own client may be blocked in a wait, and
    keys written through the clone stay under the prefix torch gave the job.
    """
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store().clone()
    except Exception:  # noqa: BLE001 - no default store, or one that cannot be cloned: nothing to note into
        return None
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def store_clock(store: dist.Store) -> int:
    """The next tick of a counter in ``store``: orders marks of this job after those of earlier ones."""
    return store.add(_CLOCK_KEY, 1)


class _StoreClients:
    """Clients of the job's store, per store they were cloned from (see [Note: store clients are
    reused]). Holds no reference to that store: a destroyed group's store (and on rank 0 its
    server) must go."""

    MAX_IDLE = 8

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[tuple[int, dist.Store]] = []
        self._template: tuple[int, dist.Store] | None = None
        """The cloning client, with the id of the store it was cloned from (one job's store at a time)."""

    def template(self, origin: dist.Store) -> dist.Store:
        """The client of ``origin`` that only clones others (a clone does not use its connection),
        with `STORE_REACH_S` as the limit its clones inherit."""
        with self._lock:
            if self._template is None or self._template[0] != id(origin) or not _answers(self._template[1]):
                template = origin.clone()
                template.set_timeout(datetime.timedelta(seconds=STORE_REACH_S))
                self._template = (id(origin), template)  # another job's store: its template goes
            return self._template[1]

    def take(self, origin: dist.Store) -> dist.Store:
        """An idle client of ``origin`` that still answers, or a new clone of it."""
        while True:
            with self._lock:
                index = next((i for i, (key, _) in enumerate(self._idle) if key == id(origin)), None)
                client = None if index is None else self._idle.pop(index)[1]
            if client is None:
                return self.template(origin).clone()
            if _answers(client):
                return client

    def give_back(self, origin: dist.Store, client: dist.Store) -> None:
        """Keep ``client`` for the next heartbeat, with `STORE_REACH_S` as its limit: checking that
        it still answers must not wait a beat's limit on a hung server."""
        client.set_timeout(datetime.timedelta(seconds=STORE_REACH_S))
        with self._lock:
            if len(self._idle) < self.MAX_IDLE:
                self._idle.append((id(origin), client))


def _answers(client: dist.Store) -> bool:
    """Whether ``client``'s server still answers (a kept client of a destroyed group's store, whose
    ``id`` a new store may have taken since, does not)."""
    try:
        client.check([_CLOCK_KEY])
        return True
    except Exception:  # noqa: BLE001 - a closed or refused connection
        return False


_STORE_CLIENTS = _StoreClients()


class _Beat:
    """What a beat thread needs, apart from its `Heartbeat`: a heartbeat dropped without
    ``stop()`` must be collectable, so that its finalizer can end the thread."""

    def __init__(self, store: dist.Store, key: str):
        self.store, self.key = store, key
        self.iteration = -1
        self.stopped = threading.Event()

    def run(self) -> None:
        count = 0
        try:
            while not self.stopped.is_set():
                count += 1
                try:
                    self.store.set(self.key, f"{count} {self.iteration}")
                except Exception:  # noqa: BLE001 - the store left with its host: nothing left to tell
                    return
                self.stopped.wait(BEAT_PERIOD_S)
        finally:
            _RUNNING.discard(threading.current_thread())


class _RunningBeats:
    """[Note: no beat at finalization] A beat thread still running when the interpreter
    finalizes is ended by CPython as it next takes the GIL: back from a store write, that
    unwinds through C++ frames that cannot be unwound, and the process aborts (SIGABRT),
    after a run that succeeded. So every beat thread is stopped and waited for at exit, while
    threads can still run: those of models never released, and those whose last write
    outlasted `Heartbeat.stop`'s wait (a write gives up after `BEAT_WRITE_S`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._beats: dict[threading.Thread, _Beat] = {}

    def add(self, thread: threading.Thread, beat: _Beat) -> None:
        with self._lock:
            self._beats[thread] = beat

    def discard(self, thread: threading.Thread) -> None:
        with self._lock:
            self._beats.pop(thread, None)

    def end_all(self) -> None:
        with self._lock:
            beats, self._beats = self._beats, {}
        for beat in beats.values():
            beat.stopped.set()
        deadline = time.monotonic() + BEAT_WRITE_S + BEAT_PERIOD_S
        for thread in beats:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


_RUNNING = _RunningBeats()
atexit.register(_RUNNING.end_all)  # registered at import, before any model's own exit handler: runs after them

_HEARTBEATS: weakref.WeakSet[Heartbeat] = weakref.WeakSet()
"""This process's heartbeats, each noting this rank's communication errors for its peers."""


def _note_failure_in_every_heartbeat(what: str) -> None:
    for heartbeat in list(_HEARTBEATS):
        heartbeat.note_failure(what)


on_communication_failure(_note_failure_in_every_heartbeat)


class Heartbeat:
    """This rank's beat into the job's store, and, after a failure, who else still beats.

    See [Note: naming the lost rank]. Needs the job's store to be a TCPStore
    (torchrun's, ``env://``, ``tcp://``); with another store there is nothing
    to beat into and failures name no rank.
    """

    def __init__(self, host: str, port: int, rank: int, peers: Sequence[int], store: dist.Store | None = None):
        """``store``: the job's store under its prefix (the default group's), whose clients this
        heartbeat takes from those others gave back, or clones (see [Note: store clients are
        reused]); None: new clients of the bare store at ``host``:``port``."""
        self._address = (host, port)
        self._rank = rank
        self._peers = [peer for peer in peers if peer != rank]
        self._origin = store
        if store is None:
            self._template = _connect(host, port, STORE_REACH_S)
            self._template.set_timeout(datetime.timedelta(seconds=STORE_REACH_S))
            self._store = self._template.clone()
        else:
            self._template, self._store = _STORE_CLIENTS.template(store), _STORE_CLIENTS.take(store)
        self._store.set_timeout(datetime.timedelta(seconds=BEAT_WRITE_S))
        self._joined = store_clock(self._store)
        """Marks written at or before this tick were left by an earlier job (see [Note: keys of this job only])."""
        self._verdict: str | None = None
        self._noted = False
        """This rank left its note of a failure of its own."""
        self._beat = _Beat(self._store, _KEY.format(rank))
        self._thread = threading.Thread(target=self._beat.run, name="commsched-heartbeat", daemon=True)
        _RUNNING.add(self._thread, self._beat)
        # A heartbeat dropped without stop() (its model never released) ends with it.
        weakref.finalize(self, self._beat.stopped.set)
        self._thread.start()
        _HEARTBEATS.add(self)

    @classmethod
    def of_group(cls, group: dist.ProcessGroup) -> Heartbeat | None:
        """A heartbeat over ``group``'s ranks, or None where the job's store is not a TCPStore."""
        address = _store_address()
        if address is None:
            return None
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            return cls(*address, dist.get_rank(), dist.get_process_group_ranks(group), _get_default_store())
        except RuntimeError:  # the store takes no more clients: train on, failures just name no rank
            logger.warning("commsched: no heartbeat (could not connect to the job's store at %s:%d); a "
                           "failed reduction will not name the lost rank", *address, exc_info=True)
            return None

    @property
    def _iteration(self) -> int:
        return self._beat.iteration

    @property
    def store_client(self) -> dist.Store | None:
        """The client of the job's store its beats are written with (None once stopped: given back)."""
        return self._store

    @property
    def cloning_client(self) -> dist.Store:
        """The client of the job's store it clones others from (a failure's note, the watch)."""
        return self._template

    @property
    def thread(self) -> threading.Thread:
        """The thread that beats, until `stop`, the heartbeat's collection, or exit."""
        return self._thread

    def at_iteration(self, iteration: int) -> None:
        """This rank began ``iteration``: the next beats say so."""
        self._beat.iteration = iteration

    def stop(self) -> None:
        """End the thread (idempotent); one still in a write after ``2 * BEAT_PERIOD_S`` is
        waited for at exit (see [Note: no beat at finalization])."""
        self._beat.stopped.set()
        self._thread.join(timeout=2 * BEAT_PERIOD_S)
        if not self._thread.is_alive() and self._origin is not None and self._store is not None:
            _STORE_CLIENTS.give_back(self._origin, self._store)  # the thread left `_RUNNING` as it ended
        self._store = None

    def note_failure(self, what: str) -> None:
        """A communication error of this rank's own, waiting for ``what``: noted (once) for the
        peers to quote. Best effort, within `STORE_REACH_S`."""
        if self._noted or self._store is None:
            return
        self._noted = True
        try:
            store = self._template.clone()
            store.set_timeout(datetime.timedelta(seconds=STORE_REACH_S))
            store.set(_FAILED_KEY.format(self._rank), f"{store_clock(store)} {what}")
        except Exception:  # noqa: BLE001 - the store may be gone with its host: nothing to tell
            logger.debug("commsched: could not note this rank's failure in the job's store", exc_info=True)

    def lost_peers(self) -> str:
        """After a failure: a sentence naming the peers that stopped beating or lag behind (watched once)."""
        if self._verdict is None:
            self._verdict = self._watch()
        return self._verdict

    def _watch(self) -> str:
        host, port = self._address
        try:
            # A plain connection first: on a cut link it fails within the limit, quietly.
            socket.create_connection(self._address, timeout=STORE_REACH_S).close()
        except ConnectionRefusedError:
            return (f"The job's store at {host}:{port} refuses connections: the process that hosted it (rank 0, "
                    "unless torchrun's agent hosts it) has ended, probably after an error of its own (a rank "
                    "that waits longer than Strategy.timeout_s for another ends with one); check its log.")
        except OSError:
            return (f"This rank cannot reach the job's store at {host}:{port} either: its own network connection "
                    "is probably down, or the store's host is.")
        try:
            store = self._template.clone()
            # Survivors end after their own error: their silence must not be taken for the cause.
            if not self._noted:
                store.set(_FAILED_KEY.format(self._rank), str(store_clock(store)))
            first = {peer: _read(store, _KEY.format(peer)) for peer in self._peers}
            latest = dict(first)
            silent = set(self._peers)
            deadline = time.monotonic() + SILENCE_S
            while silent and time.monotonic() < deadline:
                time.sleep(BEAT_PERIOD_S / 2)
                for peer in sorted(silent):
                    latest[peer] = _read(store, _KEY.format(peer))
                silent = {peer for peer in silent if latest[peer] == first[peer]}
            notes = {peer: self._failure_in_this_job(store, peer) for peer in self._peers}
            ended = {peer for peer in silent if notes[peer] is not None}
        except RuntimeError:
            return (f"The job's store at {host}:{port} accepts connections but did not answer within "
                    f"{STORE_REACH_S:g} s: the process that hosts it (rank 0, unless torchrun's agent does) is "
                    "probably stopped, hung, or ending.")
        return self._verdict_on(silent - ended, ended, {peer: _iteration_of(latest[peer]) for peer in self._peers},
                                {peer: note for peer, note in notes.items() if note})

    def _failure_in_this_job(self, store: dist.Store, peer: int) -> str | None:
        """What ``peer`` waited for when it noted a communication error of its own after this rank
        joined ("" where it did not say), or None if it noted none."""
        note = _read(store, _FAILED_KEY.format(peer))
        tick, _, what = (note or "").partition(" ")
        return what if tick.isdigit() and int(tick) > self._joined else None

    def _verdict_on(self, lost: set[int], ended: set[int], iterations: dict[int, int | None],
                    waited_for: dict[int, str]) -> str:
        """``waited_for``: per peer that noted a failure, what it waited for (see `note_failure`)."""
        verdict = []
        if lost:
            verdict.append(f"{_ranks(lost)} stopped responding: no heartbeat for {SILENCE_S:g} s (dead, "
                           "stopped, or cut off from the network).")
        if ended:
            whose = "its" if len(ended) == 1 else "their"
            verdict.append(f"{_ranks(ended)} ended after a communication error of {whose} own.")
        for peer, what in sorted(waited_for.items()):
            verdict.append(f"Rank {peer} had waited for {what}.")
        alive = set(self._peers) - lost - ended
        behind = {peer for peer in alive
                  if self._iteration >= 0 and iterations[peer] is not None and iterations[peer] < self._iteration}
        if behind:
            where = ", ".join(f"rank {peer} at {_began(iterations[peer])}" for peer in sorted(behind))
            verdict.append(
                f"{_ranks(behind)} did not answer in time: {_it_they(behind)} "
                f"still run{'s' if len(behind) == 1 else ''} "
                f"(heartbeats arrive) but had not begun iteration {self._iteration}, where this rank waits "
                f"({where}): probably busy outside this job's communication (data loading, evaluation, a "
                "checkpoint) for longer than Strategy.timeout_s, or stuck there.")
        elif alive and not lost and not ended:
            verdict.append(
                f"{_ranks(alive)} did not answer in time but still run{'s' if len(alive) == 1 else ''} (heartbeats "
                "arrive): probably slower than Strategy.timeout_s or stuck outside this job's communication, or "
                "failed with an error there; check their logs.")
        return " ".join(verdict)


def _read(store: dist.Store, key: str) -> str | None:
    return store.get(key).decode(errors="replace") if store.check([key]) else None


def _iteration_of(beat: str | None) -> int | None:
    """The iteration a beat says its rank last began (None: unknown)."""
    fields = (beat or "").split()
    return int(fields[1]) if len(fields) == 2 and fields[1].lstrip("-").isdigit() else None


def _began(iteration: int) -> str:
    return "no iteration yet" if iteration < 0 else f"iteration {iteration}"


def _ranks(ranks: set[int]) -> str:
    return f"Rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"


def _it_they(ranks: set[int]) -> str:
    return "it" if len(ranks) == 1 else "they"


def _store_address() -> tuple[str, int] | None:
    """The host and port of the job's TCPStore, or None."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
    except Exception:  # noqa: BLE001 - no default store
        return None
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return None
    return store.host, store.port


def _connect(host: str, port: int, timeout_s: float = 30.0) -> dist.TCPStore:
    """A client of its own: the process group's client may be blocked in a wait."""
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
