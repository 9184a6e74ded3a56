"""The optimizer runs on every rank, over averaged gradients: bucket by bucket where it can."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from commsched.update.base import Hyperparameters
from commsched.update.fused import BucketUpdater
from commsched.update.grad_scaling import GradScaling
from commsched.update.kinds import unsupported_reason

if TYPE_CHECKING:
    from commsched.layout.grad_layout import GradLayout


class LocalUpdate:
    """The all-reduce backend's update: torch's SGD/Adam/AdamW kernels per bucket, as each
    bucket's reduction completes; any other optimizer steps as usual once every
    reduction is done (and forward overlap is off)."""

    foreign_step_refusal = None
    sharded = None
    state_elsewhere = None
    join_refusal = None

    def __init__(self, optimizer: torch.optim.Optimizer | None, fuse_optimizer: bool, overlap_forward: bool):
        """``fuse_optimizer``, ``overlap_forward``: the `Strategy` fields of those names."""
        self._fused, self._overlap_forward = fuse_optimizer, overlap_forward
        self._updater: BucketUpdater | None = None
        self._use(optimizer)

    def _use(self, optimizer: torch.optim.Optimizer | None) -> None:
        self._optimizer = optimizer
        wants_per_bucket = self._fused or self._overlap_forward
        self.overlap_blocker: str | None = None
        if optimizer is not None and wants_per_bucket:
            self.overlap_blocker = unsupported_reason(optimizer)
        elif optimizer is None and self._overlap_forward:
            self.overlap_blocker = "no optimizer was given to prepare()"
        self._wants_per_bucket = optimizer is not None and wants_per_bucket and self.overlap_blocker is None

    def adopt(self, optimizer: torch.optim.Optimizer, layout: GradLayout | None) -> None:
        """The optimizer prepare() was not given, from now on (see [Note: an adopted optimizer])."""
        self._use(optimizer)
        if layout is not None:
            self.attach(layout)

    def attach(self, layout: GradLayout) -> None:
        if self._wants_per_bucket:
            self._updater = BucketUpdater(
                self._optimizer, [b.params for b in layout.buckets], [b.grad_views for b in layout.buckets],
                layout.bucket_slots, fused=self._fused,
            )

    def detach(self) -> None:
        self._updater = None

    @property
    def per_bucket(self) -> bool:
        return self._updater is not None

    def snapshot(self) -> Hyperparameters:
        return self._updater.snapshot()

    def update(self, bucket: int, hyperparameters: Hyperparameters, skip_slots: frozenset[int],
               scaling: GradScaling | None) -> None:
        self._updater.update(bucket, hyperparameters, skip_slots, scaling)

    def wait_updated(self, bucket: int) -> None:
        """An update is done when it returns."""

    def step_on_current_gradients(self, optimizer_step: Callable[[], object], again: bool) -> None:
        """The reductions are done and ``.grad`` is what torch.optim would see: its own step is exact."""
        optimizer_step()

    def before_backward(self, unstepped_backward: bool) -> None:
        """Two backward passes before one step accumulate, as in single-process training."""

    def check_step(self, gradients_changed: bool, scaled: bool) -> None:
        """Changed gradients are averaged gradients changed here, and the scale is applied here:
        the forward-overlap guard decides."""

    def close(self) -> None:
        """The state is the user's optimizer's own."""
