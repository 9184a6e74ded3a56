"""The process groups a prepared model communicates on, held in one place so they can all be let go of.

[Note: process groups at exit] The model, its hooks and its reducer form
reference cycles, which the garbage collector breaks only while the
interpreter finalizes. A process group that only commsched still holds (its
buffer group, or one the user destroyed) would be freed then: its destructor
joins gloo's worker threads, which may still need the interpreter lock to drop
a finished operation's tensors; a thread that asks for it during finalization
is ended from inside a C++ destructor, and the process aborts ("terminate
called without an active exception") after a clean run. So at exit, while
every thread can still run, the reducer lets go of its groups (`forget`) and
such a group is freed there. The engine's parts read the groups from this one
holder when they communicate, never keeping a group of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from commsched.comm.side_groups import destroy_own_groups


@dataclass
class ProcessGroups:
    """Where a prepared model's messages go."""

    replicas: dist.ProcessGroup | None
    """The data-parallel ranks whose gradients are averaged (with parameter servers, the workers):
    the link is measured on it."""
    buffers: dist.ProcessGroup | None
    """Buffer broadcasts and Join's counts: a side group with forward overlap, so they never queue
    behind gradient reductions (see [Note: side groups] in `commsched.comm.side_groups`)."""
    control: dist.ProcessGroup | None
    """The order, the cost model's choice, the plan and the auto-tuner's decisions (see
    [Note: control messages] in `commsched.comm.side_groups`)."""

    parameters: dist.ProcessGroup | None = None
    """With sharded optimizer state, the all-gathers of updated parameters: a group of their own
    (shared by the models sharded on one user group), since they start at the forward pass's
    gates (see [Note: sharded optimizer state] in `commsched.update.sharded`)."""

    exchange: dist.ProcessGroup | None = None
    """Where all-reduces may go in two steps (gloo, 3 or more ranks), their second steps: a group of
    their own, shared by the models prepared on one user group (see [Note: an all-reduce in two
    steps] in `commsched.comm.two_step`)."""

    owned: tuple[dist.ProcessGroup, ...] = ()
    """Groups made for this model alone (a parameter-server job's), destroyed when it lets go of
    them (see [Note: groups a model made for itself])."""

    def destroy_owned(self) -> None:
        """Not after a failure, whose groups are abandoned instead (`commsched.errors`)."""
        destroy_own_groups(self.owned)
        self.owned = ()

    def forget(self) -> None:
        self.replicas = self.buffers = self.control = self.parameters = self.exchange = None
