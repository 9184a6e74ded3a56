"""The end of a prepared model's communication: at ``commsched.release``, and at exit for one never released.

At exit, what the model still has in flight is finished first (see [Note:
operations in flight at exit]). Then it tells the peers this rank is done (the transport's `finish`), waits for the
completion callbacks still to run (see [Note: callbacks at exit] in
`commsched.engine.completion`), drops the operations of the last pass, lets go
of the process groups (see [Note: process groups at exit] in
`commsched.engine.groups`), destroying those made for the model alone (see
[Note: groups a model made for itself] in `commsched.comm.side_groups`), and
flushes the observers (the trace). After a `CommunicationTimeout` in this
process nothing waits: callbacks still to come are dropped and the groups are
abandoned, never freed (see [Note: exit after a failure] in `commsched.errors`).
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable

from commsched.comm.side_groups import forget_destroyed, forget_side_groups
from commsched.comm.transport import Transport
from commsched.device import HostSeam
from commsched.engine.backward_pass import BackwardPass
from commsched.engine.completion import CallbackTracker
from commsched.engine.events import Observer
from commsched.engine.groups import ProcessGroups
from commsched.errors import abandon_process_groups, communication_failed

FAILED_DRAIN_S = 2.0
"""After a communication failure, how long the shutdown lets operations still in flight finish."""


class Shutdown:
    """Lets go of what a model's communication holds; runs at release and again at exit (idempotent)."""

    def __init__(
        self,
        transport: Transport,
        tracker: CallbackTracker,
        events: Observer,
        groups: ProcessGroups,
        last_pass: Callable[[], BackwardPass | None],
        finish_in_flight: Callable[[], None],
        seam: HostSeam,
    ):
        """``last_pass()``: the latest backward pass, whose operations are dropped;
        ``finish_in_flight()``: at exit, waits for what the model still has in flight
        (see [Note: operations in flight at exit]); ``seam``: lets go of the operations it
        watches (see [Note: stream-ordered waits] in commsched/device.py)."""
        self._transport, self._tracker, self._events, self._groups = transport, tracker, events, groups
        self._last_pass, self._finish_in_flight, self._seam = last_pass, finish_in_flight, seam
        atexit.register(_at_exit, weakref.ref(self))

    def __call__(self) -> None:
        """Release peers, wait for callbacks, let go of the process groups, flush observers.

        Waits for no reduction (a failed run must still end): `commsched.release`
        synchronizes first.
        """
        tracker, groups = self._tracker, self._groups
        if communication_failed():
            # A peer that is alive but out of step may still finish what is in flight:
            # its callbacks must run now, while the interpreter can run them, not during
            # its finalization (which aborts the process). A lost peer never finishes:
            # wait a moment only, then stop waiting.
            tracker.drain(timeout_s=FAILED_DRAIN_S)
            tracker.abandon()
            abandon_process_groups([groups.replicas], abort=False)  # the caller's, or the job's default group
            # commsched's own, when it has them:
            own = [groups.buffers, groups.control, groups.parameters, groups.exchange]
            abandon_process_groups(own, abort=True)
            forget_side_groups(own)
        self._transport.finish()
        tracker.drain()
        last = self._last_pass()
        if last is not None:
            last.drop_handles()
        self._seam.forget()
        if not communication_failed():
            groups.destroy_owned()
        groups.forget()
        self._transport.forget_process_groups()
        forget_destroyed()  # a destroyed group's side group is freed here, like the groups above
        self._events.closed()


def _at_exit(shutdown_ref: weakref.ref) -> None:
    """[Note: operations in flight at exit] A script may end with reductions (and
    updates, all-gathers) still in flight: with forward overlap, ``step()`` returns
    before them, and nothing the script does next need wait (rank 0 writes a
    checkpoint, the other ranks just end). gloo's worker thread then finishes such
    an operation while the interpreter finalizes, and dropping it lets go of
    tensors that need the interpreter lock, which a thread cannot take then: the
    process aborts ("terminate called without an active exception") after a
    complete run, one run in four of a 2-rank script on loopback. So at exit, unless
    communication failed, a model never released first finishes what it has in
    flight (waited for as any reduction is, so a lost peer still ends it in
    ``timeout_s`` as a failure), then shuts down.
    """
    shutdown = shutdown_ref()
    if shutdown is not None:
        if not communication_failed():
            shutdown._finish_in_flight()
        shutdown()
