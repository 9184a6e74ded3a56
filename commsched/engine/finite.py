"""`Strategy.check_finite`: gradients checked for inf/NaN before they go on the wire.

[Note: non-finite gradients] One rank's inf or NaN, summed into every rank's
gradient, would silently ruin the model everywhere. With ``check_finite``
each bucket's gradients are checked on this rank as the bucket is issued,
into a device flag (torch's GradScaler kernel, no host sync). When the flags
bucket goes out last (see [Note: unused parameters] in
`commsched.engine.backward_pass`), this rank writes whether any of its buckets
held one into its own slot of the bucket's tail; the sum tells every rank the
same verdict and which ranks produced them, without a collective of its own.
Every bucket's update then waits for that verdict and takes it as a
``GradScaler``'s ``found_inf``: the fused kernels skip the step on the device,
the others skip it on the host, on every rank alike. ``"raise"`` then stops
training at the next synchronisation of the host (the next backward pass,
``optimizer.synchronize()``, or ``step()`` without forward overlap), naming the
ranks and the parameters whose averaged gradients hold them; ``"skip"`` logs
the same as a warning and trains on. With a ``GradScaler`` its own verdict
rules: infs are how it finds its scale.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from commsched.errors import NonFiniteGradients
from commsched.layout.buckets import Bucket
from commsched.update.grad_scaling import GradScaling

logger = logging.getLogger(__name__)


class FiniteCheck:
    """One backward pass's check of its gradients, from this rank's flags to the shared verdict."""

    def __init__(self, mode: str, rank: int, world_size: int, iteration: int):
        self.mode, self._rank, self._world_size, self._iteration = mode, rank, world_size, iteration
        self._found: list[torch.Tensor] = []
        self._checked: list[int] = []
        """The buckets of ``_found``, in the order they were checked."""
        self._one: torch.Tensor | None = None
        self.verdict: GradScaling | None = None
        """Once the flags bucket is reduced: non-zero ``found_inf`` if some rank found one."""
        self._message: str | None = None
        self._pending: tuple[torch.cuda.Event, torch.Tensor, torch.Tensor] | None = None
        """On a GPU: the verdict on its way to the host (see `settle`)."""

    def check(self, bucket: Bucket) -> None:
        """This rank's gradients of ``bucket``, before they are averaged and issued."""
        device = bucket.flat.device
        found = torch.zeros(1, dtype=torch.float32, device=device)
        if self._one is None or self._one.device != device:
            self._one = torch.ones(1, dtype=torch.float32, device=device)
        flag_nonfinite(bucket.grad_views, found, self._one)
        self._found.append(found)
        self._checked.append(bucket.index)

    def write_slots(self, slots: torch.Tensor) -> None:
        """Into the flags bucket's tail (``slots``, one per rank): whether this rank found any."""
        slots.zero_()
        if self._found:
            slots[self._rank].copy_(torch.cat(self._found).amax())

    def settle(self, slots: torch.Tensor, names: Callable[[], list[str]]) -> None:
        """After the flags bucket's reduction: ``slots`` say which ranks found one (the same on every rank).

        ``names()``: the parameters whose averaged gradients hold one, once every
        reduction is done, or None where this rank cannot tell them now (read only if
        some rank found one). On the CPU the verdict is read at once; on a GPU it is
        copied to the host without waiting, with this rank's own findings per bucket.
        """
        found_inf = (slots.amax() > 0).to(torch.float32)  # 0-d, as GradScaler's
        self.verdict = GradScaling(grad_scale=None, found_inf=found_inf)
        if not slots.is_cuda:
            self._message = self._explain(slots.tolist(), names)
            return
        own = torch.cat(self._found) if self._found else torch.zeros(0, device=slots.device)
        host_slots, host_own = _pinned_copy(slots), _pinned_copy(own)
        ready = torch.cuda.Event()
        ready.record()
        self._pending = (ready, host_slots, host_own)

    def report(self, bucket_names: Callable[[int], list[str]], block: bool) -> bool:
        """Raise or warn, once, if some rank found one; ``block``: wait for a GPU's verdict.

        ``bucket_names(b)``: the parameters of bucket ``b``, to name those this rank found.
        Returns False where the verdict has not reached the host yet and ``block`` is False
        (nothing told: ask again later).
        """
        if self._pending is not None:
            ready, host_slots, host_own = self._pending
            if not ready.query():
                if not block:
                    return False
                ready.synchronize()
            self._pending = None
            flagged = [b for b, found in zip(self._checked, host_own.tolist(), strict=True) if found]
            self._message = self._explain(
                host_slots.tolist(), lambda: [n for b in flagged for n in bucket_names(b)], whose="this rank's")
        message, self._message = self._message, None
        if message is None:
            return True
        if self.mode == "raise":
            raise NonFiniteGradients(message)
        logger.warning("commsched: %s", message)
        return True

    def _explain(self, slots: list[float], names: Callable[[], list[str]], whose: str = "the averaged") -> str | None:
        ranks = [r for r, found in enumerate(slots) if found > 0]
        if not ranks:
            return None
        named = names()
        shown = ", ".join(repr(n) for n in named[:8]) + (f" and {len(named) - 8} more" if len(named) > 8 else "")
        where = f"; {whose} gradients of {shown} hold them" if named else ""
        then = ("Training stops here (Strategy(check_finite='raise'))" if self.mode == "raise"
                else "Training goes on (Strategy(check_finite='skip'))")
        return (
            f"gradients with inf or NaN on rank(s) {', '.join(map(str, ranks))} in iteration {self._iteration}"
            f"{where}. The step was skipped on every rank: parameters and optimizer state are unchanged. "
            f"{then}. Look for a division by zero, a log of zero or an overflow in that rank's loss or data; "
            "with float16, use torch.amp.GradScaler."
        )


class PassVerdict:
    """A pass's `FiniteCheck` with the names of its buckets' parameters, which outlives the pass
    until its verdict is told (`VerdictsToTell`)."""

    def __init__(self, check: FiniteCheck, names: Sequence[str], bucket_slots: Sequence[Sequence[int]]):
        self._check, self._names, self._bucket_slots = check, names, bucket_slots

    def report(self, block: bool) -> bool:
        """As `FiniteCheck.report`: True once told (or nothing to tell)."""
        names, bucket_slots = self._names, self._bucket_slots
        return self._check.report(lambda b: [names[slot] for slot in bucket_slots[b]], block)


class VerdictsToTell:
    """The verdicts of passes not yet told, oldest first. On a GPU a verdict travels to the host
    without a wait, so it is told at the first backward pass or ``step()`` that finds it arrived
    (see [Note: stream-ordered waits] in commsched/device.py); on the CPU at once."""

    def __init__(self) -> None:
        self._waiting: list[PassVerdict] = []

    def tell(self, latest: PassVerdict | None, block: bool) -> None:
        """Raise or warn what ``latest`` and the verdicts before it found, as far as they have
        reached the host (``block``: wait for them)."""
        if latest is not None and all(latest is not verdict for verdict in self._waiting):
            self._waiting.append(latest)
        while self._waiting and self._waiting[0].report(block):
            self._waiting.pop(0)


def flag_nonfinite(grads: list[torch.Tensor], found: torch.Tensor, one: torch.Tensor) -> None:
    """Make ``found`` (one float32 on the gradients' device) non-zero if some of ``grads`` (one
    dtype and device) holds inf or NaN, without a host wait.

    GradScaler's kernel does it in one launch, multiplying by ``one`` (which
    changes nothing); on CUDA it has no bfloat16 version, so bfloat16 gradients
    there are checked tensor by tensor.
    """
    if grads and grads[0].is_cuda and grads[0].dtype == torch.bfloat16:
        for grad in grads:
            found.add_(torch.isfinite(grad).logical_not().any())
        return
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied to pinned host memory without making the host wait (read after an event)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
