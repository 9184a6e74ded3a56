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

__all__ = ["Hyperparameters", "UnshardedState", "UpdatePolicy"]

NOT_SHARDED = (
    "sharded checkpoints need Strategy(backend=AllReduce(shard_optimizer=True)); without it every rank holds "
    "the whole optimizer state: save optimizer.state_dict() and load it with optimizer.load_state_dict()"
)


class UnshardedState:
    """What an update policy whose optimizer state is not sharded answers about sharding."""

    def sharding(self) -> None:
        return None

    def save_sharded(self, checkpoint_id: str | os.PathLike) -> None:
        raise ValueError(NOT_SHARDED)

    def load_sharded(self, checkpoint_id: str | os.PathLike) -> None:
        raise ValueError(NOT_SHARDED)


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

    step_records: StepRecords | None
    """How a rank out of batches under ``Join`` learns the others' steps, where it must update
    state of its own at each (sharded state: see [Note: a joined rank's shard] in
    `commsched.update.step_records`); None where it need not."""

    update_order: tuple[int, ...] | None
    """The order buckets must be updated in, the same on every rank (their updates start
    collectives: see [Note: sharded optimizer state] in `commsched.update.sharded`), or None:
    any order."""

    local_updates: frozenset[int]
    """Buckets whose update starts no collective (sharded state's bucket kept whole): they may be
    updated out of `update_order` (see [Note: updates ahead of a local bucket] in
    `commsched.engine.backward_pass`)."""

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

    def fetch_optimizer_state(self) -> None:
        """Before ``optimizer.state_dict()``: bring state kept elsewhere into ``optimizer.state``."""

    def drop_fetched_state(self) -> None:
        """After ``optimizer.state_dict()`` (or a copy) read what `fetch_optimizer_state` brought."""

    def push_optimizer_state(self) -> None:
        """After ``optimizer.load_state_dict()``: send the loaded state where it is used."""

    def push_parameters(self) -> None:
        """After ``model.load_state_dict()``: send the loaded values where they are kept."""

    def close(self) -> None:
        """``commsched.release``: the optimizer steps on its own from now on; give it what it needs."""

    def sharding(self) -> ShardStatus | None:
        """With sharded optimizer state, its layout and this rank's bytes; else None."""

    def save_sharded(self, checkpoint_id: str | os.PathLike) -> None:
        """Each rank writes its own part of the optimizer state (``torch.distributed.checkpoint``)."""

    def load_sharded(self, checkpoint_id: str | os.PathLike) -> None:
        """Each rank reads its own part of the optimizer state, written by `save_sharded`."""
