"""Errors a training job sees, the one way commsched waits on communication, and what a
failure leaves behind.

Every wait on a ``torch.distributed`` operation goes through `wait_work`, and
every failed or overdue one becomes a `CommunicationTimeout` worded by
`communication_timeout`: it names the rank, what was waited for, how long, and
what probably happened, instead of a hang or a bare gloo error.

[Note: exit after a failure] An operation a lost peer never joins stays in its
group's worker thread until the group's own timeout (torch's default: 30
minutes), and freeing the group joins that thread: a process that got its error
in seconds would then take half an hour to exit, and abort at the end. gloo
groups cannot be aborted (``abort()`` does nothing for them in torch 2.13), so
once a `CommunicationTimeout` was raised in a process, commsched shuts down
without waiting for anything in flight and `abandon_process_groups` the groups
its reductions used: it aborts those it created, where the backend can, and
keeps every one of them from ever being freed, so the interpreter exits without
joining their stuck threads.
"""

from __future__ import annotations

import ctypes
import datetime
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch.distributed as dist


class CommunicationTimeout(RuntimeError):
    """A reduction did not finish in time: a peer died, hung, or raised an error."""


PEER_LOST = ("Another rank probably died, raised an error, was busy elsewhere for longer than the timeout, or runs "
             "different code; check its log")

_failures = 0
"""How many `CommunicationTimeout`\\ s were made in this process."""

_abandoned: set[int] = set()
"""ids of the groups `abandon_process_groups` keeps alive."""

_failure_listeners: list[Callable[[str], None]] = []
"""Told what was waited for, at each `CommunicationTimeout` made (`on_communication_failure`)."""


def on_communication_failure(listener: Callable[[str], None]) -> None:
    """Tell ``listener`` what was waited for whenever a `CommunicationTimeout` is made in this
    process (the heartbeat notes it for the peers: [Note: naming the lost rank] in
    `commsched.comm.heartbeat`). A listener must not raise, nor block for long."""
    _failure_listeners.append(listener)


def wait_work(work: dist.Work, timeout_s: float | None) -> None:
    """Wait for ``work`` at most ``timeout_s`` seconds (None: the process group's own timeout)."""
    if timeout_s is None:
        work.wait()
    else:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))


def communication_timeout(
    what: str, timeout_s: float, error: BaseException | None, *, who: str | None = None, cause: str = PEER_LOST
) -> CommunicationTimeout:
    """The error for ``what`` having failed or overrun ``timeout_s``, with its likely ``cause``."""
    global _failures
    _failures += 1
    for listener in _failure_listeners:
        listener(what)
    if who is None:
        who = f"rank {dist.get_rank() if dist.is_initialized() else 0}"
    detail = f" ({error})" if error is not None else ""
    return CommunicationTimeout(
        f"{who}: {what} failed or did not finish within {timeout_s:g} s{detail}. {cause}. "
        "Raise Strategy.timeout_s if this legitimately takes longer."
    )


def wait_or_raise(work: dist.Work, timeout_s: float, what: str) -> None:
    """Wait for ``work``; turn a failure or a timeout into `CommunicationTimeout` naming ``what``."""
    try:
        wait_work(work, timeout_s)
    except RuntimeError as error:
        raise communication_timeout(what, timeout_s, error) from error


def communication_failed() -> bool:
    """Whether communication failed in this process: its groups may hold work that never ends."""
    return _failures > 0


@contextmanager
def failures_explained(explain: Callable[[CommunicationTimeout], None]) -> Iterator[None]:
    """A `CommunicationTimeout` raised inside goes through ``explain`` (a transport's
    ``explain_failure``, which names the lost rank) on its way up."""
    try:
        yield
    except CommunicationTimeout as error:
        explain(error)
        raise


def abandon_process_groups(groups: Iterable[dist.ProcessGroup | None], *, abort: bool) -> None:
    """After a failure: never free ``groups``; with ``abort``, abort them first where the backend can.

    See [Note: exit after a failure]. Only for groups this process will not use
    again: a group whose collective failed is out of step with its peers anyway.
    """
    for group in groups:
        if group is None or id(group) in _abandoned:
            continue
        _abandoned.add(id(group))
        if abort:
            try:
                group.abort()
            except Exception:  # noqa: BLE001 - best effort: keeping it alive is what lets the process exit
                pass
        # A reference nothing ever drops: the interpreter's finalization cannot free it either.
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


class NonFiniteGradients(RuntimeError):
    """Some rank's gradients held inf or NaN (``Strategy(check_finite="raise")``); the step was skipped
    on every rank. The message names the ranks and the parameters whose averaged gradients hold them."""
