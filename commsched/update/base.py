"""What an update policy is: where the optimizer runs, and how a bucket gets its new values."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from commsched.update.kinds import Hyperparameters

if TYPE_CHECKING:
    import torch

    from commsched.layout.grad_layout import GradLayout
    from commsched.layout.shards import ShardStatus
    from commsched.update.grad_scaling import GradScaling
    from commsched.update.step_records import StepRecords

__all__ = ["Hyperparameters", "ShardedState", "StateElsewhere", "UpdatePolicy"]

class ShardedState(Protocol):
    """Optimizer state sharded across the replicas (an optional capability: `UpdatePolicy.sharded`)."""

    update_order: tuple[int, ...] | None
    """The order buckets must be updated in, the same on every rank (their updates start
    collectives: see [Note: sharded optimizer state] in `commsched.update.sharded`); None until
    the buckets exist."""

    local_updates: frozenset[int]
    """Buckets whose update starts no collective (the bucket kept whole): they may be updated out
    of `update_order` (see [Note: updates ahead of a local bucket] in `commsched.engine.backward_pass`)."""

    step_records: StepRecords
    """How a rank out of batches under ``Join`` learns the others' steps, to update its own part at
    each (see [Note: a joined rank's shard] in `commsched.update.step_records`)."""

    def status(self) -> ShardStatus:
        """Its layout and this rank's bytes of state."""

    def save(self, checkpoint_id: str | os.PathLike) -> None:
        """Each rank writes its own part of the optimizer state (``torch.distributed.checkpoint``)."""

    def load(self, checkpoint_id: str | os.PathLike) -> None:
        """Each rank reads its own part of the optimizer state, written by `save`."""


class StateElsewhere(Protocol):
    """Optimizer state or parameters kept apart from the user's optimizer and model (sharded, or on
    parameter servers): an optional capability, `UpdatePolicy.state_elsewhere`."""

    def fetch(self) -> None:
        """Before ``optimizer.state_dict()``: bring the state into ``optimizer.state``."""

    def drop_fetched(self) -> None:
        """After ``optimizer.state_dict()`` (or a copy) read what `fetch` brought."""

    def push_optimizer_state(self) -> None:
        """After ``optimizer.load_state_dict()``: send the loaded state where it is used."""

    def push_parameters(self) -> None:
        """After ``model.load_state_dict()``: send the loaded values where they are kept."""


class UpdatePolicy(Protocol):
    """Built by `commsched.prepare` for its backend, beside the transport."""

    overlap_blocker: str | None
    """Why forward overlap is impossible with this optimizer, or None."""

    foreign_step_refusal: str | None
    """Why another optimizer's ``step()`` on these parameters can never be right with this
    backend (see [Note: foreign optimizers] in `commsched.prepared.foreign_optimizers`), or None."""

    def attach(self, layout: GradLayout) -> None:
        """The buckets exist: prepare the per-bucket update (if any)."""

    def adopt(self, optimizer: torch.optim.Optimizer, layout: GradLayout | None) -> None:
        """Use ``optimizer``, which prepare() was not given (see [Note: an adopted optimizer]
        in `commsched.engine.reducer`); only where the optimizer runs on every rank."""

    def detach(self) -> None:
        """The buckets are about to be laid out anew: let go of them (until `attach`)."""

    @property
    def per_bucket(self) -> bool:
        """True once buckets are updated one by one; False: the optimizer's own
        ``step()`` runs after every reduction has completed."""

    join_refusal: str | None
    """Why a rank out of batches cannot shadow the others' iterations under torch's ``Join``
    with this update (see `Transport.join_refusal`), or None where it can."""

    sharded: ShardedState | None
    """With sharded optimizer state, how it is sharded; None where every rank holds all of it."""

    state_elsewhere: StateElsewhere | None
    """Where optimizer state or parameters are kept apart from the user's objects, how they are
    brought back and sent there; None where the user's optimizer and model hold them."""

    def snapshot(self) -> Hyperparameters:
        """The hyper-parameters to update with, read at ``step()``."""

    def update(self, bucket: int, hyperparameters: Hyperparameters, skip_slots: frozenset[int],
               scaling: GradScaling | None) -> None:
        """Give ``bucket``'s parameters their new values (``skip_slots``: no rank had a gradient;
        ``scaling``: a ``GradScaler``'s scale and verdict, see [Note: GradScaler])."""

    def wait_updated(self, bucket: int) -> None:
        """What `update` left in flight for ``bucket`` is done: its parameters are final."""

    def step_on_current_gradients(self, optimizer_step: Callable[[], object], again: bool) -> None:
        """A ``step()`` without this pass's reduced gradients: a second one after
        the pass's own (``again``), or one after ``zero_grad()`` dropped them. Do
        what torch.optim does with ``.grad`` as it is now, or refuse."""

    def before_backward(self, unstepped_backward: bool) -> None:
        """A synchronised backward pass is about to begin (``unstepped_backward``: the one
        before it had no ``step()``)."""

    def check_step(self, gradients_changed: bool, scaled: bool) -> None:
        """At ``step()``: raise if this step cannot give the right parameters
        (``gradients_changed``: in place, after they were issued; ``scaled``: a
        ``GradScaler`` steps the optimizer)."""

    def close(self) -> None:
        """``commsched.release``: the optimizer steps on its own from now on; give it what it needs."""
