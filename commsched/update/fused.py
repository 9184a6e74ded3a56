"""Per-bucket optimizer updates for SGD, Adam and AdamW.

Each bucket's parameters are updated on their own, as soon as the bucket's
reduction is complete, with torch's functional optimizer kernels (``fused=True``
on request, for float32 and float64 parameters) over the bucket's gradient
views. State lives in the user's optimizer (``optimizer.state[param]``),
created exactly as torch.optim creates it, so checkpoints move freely between
commsched and plain torch.optim. Only parameters of one param group share a
call (Paddle's "fuse only identical optimizers"), and the hyper-parameters are
those of the ``step()`` call that released the update, so an LR scheduler
stepped right after ``step()`` does not leak into this iteration.

[Note: low-precision parameters] torch's fused kernels compute a float16 or
bfloat16 update in float32 and round once, where torch.optim's default kernels
(a loop over tensors on CPU, ``foreach`` on GPU) round after every operation:
within ten steps they differ by many units in the last place, and with
torch 2.13 the fused CPU SGD kernel leaves most elements of such a parameter
unchanged (and its momentum is not even reproducible). So ``Strategy(fuse_optimizer=True)`` fuses only float32 and float64
buckets; low-precision ones get the kernel the param group itself asks for
(its ``fused`` and ``foreach``, as torch.optim's ``step()`` passes them), which
gives torch.optim's own results bit for bit.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.adam import adam as functional_adam
from torch.optim.sgd import sgd as functional_sgd

from commsched.update.grad_scaling import GradScaling
from commsched.update.kinds import hyperparameter_snapshot, optimizer_kind

FUSED_DTYPES = frozenset({torch.float32, torch.float64})
"""Where torch's fused kernels match torch.optim's default ones to float tolerance;
see [Note: low-precision parameters]."""


@dataclass
class _Segment:
    """The parameters of one bucket that belong to one param group."""

    group: int
    params: list[torch.nn.Parameter]
    grads: list[torch.Tensor]
    slots: list[int]


class BucketUpdater:
    """Runs the user's SGD/Adam/AdamW update on one bucket at a time."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        bucket_params: Sequence[Sequence[torch.nn.Parameter]],
        bucket_grads: Sequence[Sequence[torch.Tensor]],
        bucket_slots: Sequence[Sequence[int]],
        fused: bool,
        *,
        state: MutableMapping[torch.Tensor, dict[str, Any]] | None = None,
        bucket_groups: Sequence[Sequence[int | None]] | None = None,
    ):
        """``state``: where the per-tensor state lives (default: ``optimizer.state``, keyed by
        parameter); ``bucket_groups``: each tensor's param group (default: found by parameter).
        Both given, the tensors may be fragments of parameters (`commsched.update.sharded`)."""
        self.optimizer = optimizer
        self.kind = optimizer_kind(optimizer)
        self.fused = fused
        self.state = optimizer.state if state is None else state
        group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        if bucket_groups is None:
            bucket_groups = [[group_of.get(id(param)) for param in params] for params in bucket_params]
        self.segments: list[list[_Segment]] = []
        for params, grads, slots, groups in zip(bucket_params, bucket_grads, bucket_slots, bucket_groups, strict=True):
            by_group: dict[int, _Segment] = {}
            for param, grad, slot, group in zip(params, grads, slots, groups, strict=True):
                if group is None:
                    continue  # reduced, but the optimizer does not own it
                segment = by_group.setdefault(group, _Segment(group, [], [], []))
                segment.params.append(param)
                segment.grads.append(grad)
                segment.slots.append(slot)
            self.segments.append(list(by_group.values()))

    def snapshot(self) -> list[dict[str, object]]:
        """The hyper-parameters of every group now (taken at ``step()``)."""
        return hyperparameter_snapshot(self.optimizer, self.kind)

    @torch.no_grad()
    def update(self, bucket: int, hyperparameters: list[dict[str, object]], skip_slots: frozenset[int] = frozenset(),
               scaling: GradScaling | None = None) -> None:
        """Update ``bucket``'s parameters, leaving out ``skip_slots`` (no gradient on any rank).

        ``scaling``: the gradients carry a ``GradScaler``'s scale, and its verdict
        may skip the step (see [Note: GradScaler] in commsched/update/grad_scaling.py).
        """
        for segment in self.segments[bucket]:
            params, grads = segment.params, segment.grads
            if skip_slots:
                kept = [i for i, slot in enumerate(segment.slots) if slot not in skip_slots]
                params, grads = [params[i] for i in kept], [grads[i] for i in kept]
            if not params:
                continue
            hp = hyperparameters[segment.group]
            flags = self._kernel_flags(params, hp)
            scaled: dict[str, torch.Tensor | None] = {}
            if scaling is not None:
                if flags["fused"]:
                    scaled = scaling.kernel_arguments(params[0].device)
                elif scaling.skipped:
                    continue
                else:
                    scaling.unscale_(grads)
            if self.kind == "sgd":
                self._sgd(params, grads, hp, flags, scaled, scaling)
            else:
                self._adam(params, grads, hp, flags, scaled)

    def _kernel_flags(self, params: list, hp: dict[str, object]) -> dict[str, bool | None]:
        """The kernel: fused where requested and exact enough, else the param group's own choice."""
        if self.fused and params[0].dtype in FUSED_DTYPES:
            return {"fused": True, "foreach": False}
        return {"fused": hp["fused"], "foreach": hp["foreach"]}

    def _sgd(self, params: list, grads: list, hp: dict[str, object], flags: dict[str, bool | None],
             scaled: dict[str, torch.Tensor | None], scaling: GradScaling | None) -> None:
        state = self.state
        momentum = hp["momentum"]
        kwargs = dict(
            weight_decay=hp["weight_decay"], momentum=momentum, lr=hp["lr"],
            dampening=hp["dampening"], nesterov=hp["nesterov"], maximize=hp["maximize"], **flags, **scaled,
        )
        if momentum == 0:
            functional_sgd(params, grads, [None] * len(params), **kwargs)
            return
        buffers = [state[p].get("momentum_buffer") for p in params]
        # Fused SGD wants all momentum buffers or none: a parameter first seen
        # after others (unused until now) takes its first step separately.
        for has_buffer in (True, False):
            chosen = [i for i, b in enumerate(buffers) if (b is not None) == has_buffer]
            if not chosen:
                continue
            if not has_buffer and scaled and scaling.skipped:
                # The fused kernel's first step makes uninitialised buffers, which a
                # skipped step would leave as they are: take no first step instead.
                continue
            chosen_buffers = [buffers[i] for i in chosen]
            functional_sgd([params[i] for i in chosen], [grads[i] for i in chosen], chosen_buffers, **kwargs)
            for i, buffer in zip(chosen, chosen_buffers):
                state[params[i]]["momentum_buffer"] = buffer

    def _adam(self, params: list, grads: list, hp: dict[str, object], flags: dict[str, bool | None],
              scaled: dict[str, torch.Tensor | None]) -> None:
        state = self.state
        amsgrad = hp["amsgrad"]
        fused = bool(flags["fused"])
        exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], []
        for param in params:
            s = state[param]
            if not s:
                s["step"] = (torch.zeros((), dtype=torch.float32, device=param.device) if fused
                             else torch.tensor(0.0, dtype=torch.float32))
                s["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                s["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if amsgrad:
                    s["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            elif fused and s["step"].device != param.device:
                s["step"] = s["step"].to(param.device)
            exp_avgs.append(s["exp_avg"])
            exp_avg_sqs.append(s["exp_avg_sq"])
            if amsgrad:
                max_exp_avg_sqs.append(s["max_exp_avg_sq"])
            steps.append(s["step"])
        beta1, beta2 = hp["betas"]
        decoupled = hp["decoupled_weight_decay"]
        functional_adam(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
            decoupled_weight_decay=self.kind == "adamw" if decoupled is None else bool(decoupled),
            amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=hp["lr"],
            weight_decay=hp["weight_decay"], eps=hp["eps"], maximize=hp["maximize"], **flags, **scaled,
        )
