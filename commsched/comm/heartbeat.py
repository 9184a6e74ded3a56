"""Every rank beats into the job's store, so that a survivor of a failed collective can name the lost rank.

[Note: naming the lost rank] A gloo collective that fails says only that it
timed out, or which socket closed, not which rank is gone. So every rank of a
multi-rank group beats: a thread of its own writes a counter into the job's
key-value store every `BEAT_PERIOD_S` (a write needs no answer, so a beat never
blocks, even cut off from the network). After a failed reduction, a survivor
reads every peer's counter over `SILENCE_S`: a rank whose counter did not move
is dead, stopped, or cut off, and the error names it. Nothing runs per
iteration; a failure costs `SILENCE_S` more.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from collections.abc import Sequence

import torch.distributed as dist

BEAT_PERIOD_S = 0.5
"""How often every rank writes its heartbeat."""


SILENCE_S = 2.5
"""How long a survivor watches its peers' heartbeats before naming those that did not beat."""


STORE_REACH_S = 3.0
"""How long a survivor tries to reach the job's store before concluding it cannot."""


logger = logging.getLogger("commsched")

_KEY = "commsched/heartbeat/{}"


_FAILED_KEY = "commsched/failed/{}"


class Heartbeat:
    """This rank's beat into the job's store, and, after a failure, who else still beats.

    See [Note: naming the lost rank]. Needs the job's store to be a TCPStore
    (torchrun's, ``env://``, ``tcp://``); with another store there is nothing
    to beat into and failures name no rank.
    """

    def __init__(self, host: str, port: int, rank: int, peers: Sequence[int]):
        self._address = (host, port)
        self._rank = rank
        self._peers = [peer for peer in peers if peer != rank]
        self._stop = threading.Event()
        self._store = _connect(host, port)
        self._verdict: str | None = None
        self._thread = threading.Thread(target=self._beat, name="commsched-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def of_group(cls, group: dist.ProcessGroup) -> Heartbeat | None:
        """A heartbeat over ``group``'s ranks, or None where the job's store is not a TCPStore."""
        address = _store_address()
        if address is None:
            return None
        try:
            return cls(*address, dist.get_rank(), dist.get_process_group_ranks(group))
        except RuntimeError:  # the store takes no more clients: train on, failures just name no rank
            logger.warning("commsched: no heartbeat (could not connect to the job's store at %s:%d); a "
                           "failed reduction will not name the lost rank", *address, exc_info=True)
            return None

    def _beat(self) -> None:
        key, count = _KEY.format(self._rank), 0
        while True:
            count += 1
            try:
                self._store.set(key, str(count))
            except Exception:  # noqa: BLE001 - the store left with its host: nothing left to tell
                return
            if self._stop.wait(BEAT_PERIOD_S):
                return

    def stop(self) -> None:
        """End the thread (idempotent): it must be gone before the interpreter finalizes."""
        self._stop.set()
        self._thread.join(timeout=2 * BEAT_PERIOD_S)
        self._store = None

    def lost_peers(self) -> str:
        """After a failure: a sentence naming the peers that stopped beating (watched once)."""
        if self._verdict is None:
            self._verdict = self._watch()
        return self._verdict

    def _watch(self) -> str:
        host, port = self._address
        try:
            # A plain connection first: on a cut link it fails within the limit, quietly.
            socket.create_connection(self._address, timeout=STORE_REACH_S).close()
            store = _connect(host, port, timeout_s=STORE_REACH_S)
        except (OSError, RuntimeError):
            return (f"This rank cannot reach the job's store at {host}:{port} either: its own network "
                    "connection is probably down, or the store's host died.")
        keys = {peer: _KEY.format(peer) for peer in self._peers}

        def beats(peer: int) -> bytes | None:
            return store.get(keys[peer]) if store.check([keys[peer]]) else None

        try:
            # Survivors end after their own error: their silence must not be taken for the cause.
            store.set(_FAILED_KEY.format(self._rank), "1")
            first = {peer: beats(peer) for peer in self._peers}
            silent = set(self._peers)
            deadline = time.monotonic() + SILENCE_S
            while silent and time.monotonic() < deadline:
                time.sleep(BEAT_PERIOD_S / 2)
                silent = {peer for peer in silent if beats(peer) == first[peer]}
            ended = {peer for peer in silent if store.check([_FAILED_KEY.format(peer)])}
        except RuntimeError:
            return (f"The job's store at {host}:{port} closed while this rank read the heartbeats: the "
                    "process that hosts it (rank 0, unless torchrun's agent does) has probably ended.")
        lost = silent - ended
        verdict = []
        if lost:
            verdict.append(f"{_ranks(lost)} stopped responding: no heartbeat for {SILENCE_S:g} s (dead, "
                           "stopped, or cut off from the network).")
        if ended:
            whose = "its" if len(ended) == 1 else "their"
            verdict.append(f"{_ranks(ended)} ended after a communication error of {whose} own.")
        if not silent:
            verdict.append("Every other rank's process still runs (their heartbeats arrive): one of them is "
                           "probably stuck outside this job's communication, or raised an error.")
        return " ".join(verdict)


def _ranks(ranks: set[int]) -> str:
    return f"Rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"


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
