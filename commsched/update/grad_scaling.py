"""``torch.amp.GradScaler`` with a prepared optimizer: what the scaler hands to ``step()``.

[Note: GradScaler] A prepared optimizer declares that it handles loss scaling
itself (``_step_supports_amp_scaling``), as torch's fused optimizers do. So
``GradScaler.step`` does not unscale the gradients in place and decide alone
whether to step; it checks them for infs/NaNs (``found_inf``), then calls
``step()`` with ``grad_scale`` (None after an explicit ``scaler.unscale_``)
and ``found_inf`` set on the optimizer.

The check reads every gradient, so it needs every reduction finished, and no
bucket may be updated before it: a bucket updated as soon as it is reduced,
and an inf found later in another one, would step half the model on a step
the scaler skips. So with a scaler, updates run at ``step()`` once every
reduction is done: warm-up sees the scaler and switches forward overlap off
(`GRAD_SCALER_REASON`); a scaler first seen later, with reductions in flight,
is refused. Communication still overlaps the backward pass.

Where the update runs torch's fused kernels, they take ``grad_scale`` and
``found_inf`` as they are (on a GPU, without a host sync). Other kernels, and
optimizers commsched does not update per bucket, get what ``GradScaler`` does
for an optimizer without that support: the gradients are unscaled in place and
the step is skipped when an inf/NaN was found.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

GRAD_SCALER_REASON = (
    "a torch.amp.GradScaler steps the optimizer: its check for infs/NaNs needs every gradient "
    "reduced before any bucket is updated"
)

_GIVEN = ("grad_scale", "found_inf")
"""The attributes ``GradScaler.step`` sets on the optimizer for the length of ``step()``."""


@dataclass
class GradScaling:
    """The loss scale and the inf/NaN verdict ``GradScaler.step`` gave this ``step()``."""

    grad_scale: torch.Tensor | None
    """The scale the gradients still carry; None once ``scaler.unscale_`` removed it."""
    found_inf: torch.Tensor
    """Non-zero: some gradient is inf or NaN, and the step must change nothing."""
    _skipped: bool | None = field(default=None, repr=False)

    @classmethod
    def given_to(cls, optimizer: torch.optim.Optimizer) -> GradScaling | None:
        """What a ``GradScaler`` handed ``optimizer`` for this ``step()``; None without one."""
        found_inf = getattr(optimizer, "found_inf", None)
        if found_inf is None:
            return None
        return cls(getattr(optimizer, "grad_scale", None), found_inf)

    @property
    def skipped(self) -> bool:
        """Whether the step is skipped (read on the host once: a sync on GPU)."""
        if self._skipped is None:
            self._skipped = bool(self.found_inf.item())
        return self._skipped

    def kernel_arguments(self, device: torch.device) -> dict[str, torch.Tensor | None]:
        """``grad_scale`` and ``found_inf`` for torch's fused kernels on ``device``."""
        scale = None if self.grad_scale is None else self.grad_scale.to(device, non_blocking=True)
        return {"grad_scale": scale, "found_inf": self.found_inf.to(device, non_blocking=True)}

    @torch.no_grad()
    def unscale_(self, grads: Sequence[torch.Tensor]) -> None:
        """Divide ``grads`` by the scale in place, exactly as ``GradScaler.unscale_`` does."""
        if self.grad_scale is None or not grads:
            return
        inverse = self.grad_scale.double().reciprocal().float()
        for device in {g.device for g in grads}:
            torch._foreach_mul_([g for g in grads if g.device == device], inverse.to(device))


def step_as_grad_scaler_would(
    optimizer: torch.optim.Optimizer, optimizer_step: Callable[[], object], scaling: GradScaling
) -> object:
    """Run the user's own ``optimizer.step`` under ``scaling``, as ``GradScaler.step`` would have.

    torch's fused optimizers take ``grad_scale``/``found_inf`` themselves;
    any other one gets unscaled gradients, no step on an inf/NaN, and never
    sees the two attributes (torch's unfused kernels refuse them).
    """
    if optimizer.__dict__.get("_step_supports_amp_scaling", False):
        return optimizer_step()
    if scaling.skipped:
        return None
    scaling.unscale_([p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None])
    with _hidden_from(optimizer):
        return optimizer_step()


def forget_given(optimizer: torch.optim.Optimizer) -> None:
    """After a ``step()`` that raised: the scaler, interrupted, never removes its attributes."""
    for name in _GIVEN:
        optimizer.__dict__.pop(name, None)


@contextmanager
def _hidden_from(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Remove the scaler's attributes from ``optimizer`` for a while (the scaler deletes them after)."""
    saved = {name: optimizer.__dict__.pop(name) for name in _GIVEN if name in optimizer.__dict__}
    try:
        yield
    finally:
        optimizer.__dict__.update(saved)
