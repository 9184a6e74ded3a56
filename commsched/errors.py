"""Errors a training job sees, and the one way commsched waits on communication.

Every wait on a ``torch.distributed`` operation goes through `wait_work`, and
every failed or overdue one becomes a `CommunicationTimeout` worded by
`communication_timeout`: it names the rank, what was waited for, how long, and
what probably happened, instead of a hang or a bare gloo error.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist


class CommunicationTimeout(RuntimeError):
    """A reduction did not finish in time: a peer died, hung, or raised an error."""


PEER_LOST = "Another rank probably died, raised an error, or runs different code; check its log"


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
