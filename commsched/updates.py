"""Per-bucket optimizer updates for SGD, Adam and AdamW.

Each bucket's parameters are updated on their own, as soon as the bucket's
reduction is complete, with torch's functional optimizer kernels (``fused=True``
on request) over the bucket's gradient views. State lives in the user's
optimizer (``optimizer.state[param]``), created exactly as torch.optim creates
it, so checkpoints move freely between commsched and plain torch.optim. Only
parameters of one param group share a call (Paddle's "fuse only identical
optimizers"), and the hyper-parameters are those of the ``step()`` call that
released the update, so an LR scheduler stepped right after ``step()`` does not
leak into this iteration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.optim.adam import adam as functional_adam
from torch.optim.sgd import sgd as functional_sgd

_KINDS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}
_HYPERPARAMETERS = {
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
    "adam": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay"),
}
_HYPERPARAMETERS["adamw"] = _HYPERPARAMETERS["adam"]


def _user_class(optimizer: torch.optim.Optimizer) -> type:
    """The optimizer's own class, behind commsched's mixin once prepared."""
    from commsched.optim import CommschedOptimizer

    cls = type(optimizer)
    return cls.__bases__[-1] if issubclass(cls, CommschedOptimizer) else cls


def unsupported_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot be updated bucket by bucket, or None if it can."""
    kind = _KINDS.get(_user_class(optimizer))
    if kind is None:
        return (
            f"{_user_class(optimizer).__name__} has no per-bucket update (only torch.optim.SGD, Adam "
            "and AdamW do); it steps as usual once every reduction is done"
        )
    for index, group in enumerate(optimizer.param_groups):
        for option in ("differentiable", "capturable"):
            if group.get(option):
                return f"param_groups[{index}] sets {option}=True, which per-bucket updates do not support"
        if any(torch.is_complex(p) for p in group["params"]):
            return f"param_groups[{index}] holds complex parameters"
    return None


def hyperparameter_snapshot(optimizer: torch.optim.Optimizer, kind: str) -> list[dict[str, object]]:
    """The hyper-parameters of every param group of ``optimizer`` now."""
    keys = _HYPERPARAMETERS[kind]
    return [{k: group.get(k) for k in keys} | {"foreach": group.get("foreach"), "fused": group.get("fused")}
            for group in optimizer.param_groups]


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
    ):
        reason = unsupported_reason(optimizer)
        if reason is not None:
            raise ValueError(reason)
        self.optimizer = optimizer
        self.kind = _KINDS[_user_class(optimizer)]
        self.fused = fused
        group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self.segments: list[list[_Segment]] = []
        for params, grads, slots in zip(bucket_params, bucket_grads, bucket_slots, strict=True):
            by_group: dict[int, _Segment] = {}
            for param, grad, slot in zip(params, grads, slots, strict=True):
                group = group_of.get(id(param))
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
    def update(self, bucket: int, hyperparameters: list[dict[str, object]], skip_slots: frozenset[int] = frozenset()) -> None:
        """Update ``bucket``'s parameters, leaving out ``skip_slots`` (no gradient on any rank)."""
        for segment in self.segments[bucket]:
            params, grads = segment.params, segment.grads
            if skip_slots:
                kept = [i for i, slot in enumerate(segment.slots) if slot not in skip_slots]
                params, grads = [params[i] for i in kept], [grads[i] for i in kept]
            if params:
                hp = hyperparameters[segment.group]
                if self.kind == "sgd":
                    self._sgd(params, grads, hp)
                else:
                    self._adam(params, grads, hp)

    def _kernel_flags(self, hp: dict[str, object]) -> dict[str, bool | None]:
        if self.fused:
            return {"fused": True, "foreach": False}
        return {"fused": hp["fused"], "foreach": hp["foreach"]}

    def _sgd(self, params: list, grads: list, hp: dict[str, object]) -> None:
        state = self.optimizer.state
        momentum = hp["momentum"]
        kwargs = dict(
            weight_decay=hp["weight_decay"], momentum=momentum, lr=hp["lr"],
            dampening=hp["dampening"], nesterov=hp["nesterov"], maximize=hp["maximize"],
            **self._kernel_flags(hp),
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
            chosen_buffers = [buffers[i] for i in chosen]
            functional_sgd([params[i] for i in chosen], [grads[i] for i in chosen], chosen_buffers, **kwargs)
            for i, buffer in zip(chosen, chosen_buffers):
                state[params[i]]["momentum_buffer"] = buffer

    def _adam(self, params: list, grads: list, hp: dict[str, object]) -> None:
        state = self.optimizer.state
        amsgrad = hp["amsgrad"]
        fused = self.fused or bool(hp["fused"])
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
            weight_decay=hp["weight_decay"], eps=hp["eps"], maximize=hp["maximize"],
            **self._kernel_flags(hp),
        )


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """``"sgd"``, ``"adam"`` or ``"adamw"``; raises ValueError for any other optimizer."""
    reason = unsupported_reason(optimizer)
    if reason is not None:
        raise ValueError(reason)
    return _KINDS[_user_class(optimizer)]


def _encoded_fields(kind: str) -> tuple[str, ...]:
    if kind == "sgd":
        return _HYPERPARAMETERS["sgd"]
    return ("lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay")


def encoded_length(kind: str, num_groups: int) -> int:
    return len(_encoded_fields(kind)) * num_groups


def encode_hyperparameters(kind: str, snapshot: list[dict[str, object]]) -> list[float]:
    """A `BucketUpdater.snapshot()` as numbers (to send a parameter server with each iteration)."""
    values: list[float] = []
    for group in snapshot:
        flat = dict(group)
        if kind != "sgd":
            flat["beta1"], flat["beta2"] = group["betas"]
            decoupled = group.get("decoupled_weight_decay")
            flat["decoupled_weight_decay"] = -1.0 if decoupled is None else float(bool(decoupled))
        values.extend(float(flat[name]) for name in _encoded_fields(kind))
    return values


def decode_hyperparameters(kind: str, values: list[float], num_groups: int) -> list[dict[str, object]]:
    """The inverse of `encode_hyperparameters` (kernel choices left to the updater)."""
    names = _encoded_fields(kind)
    booleans = {"nesterov", "maximize", "amsgrad"}
    groups: list[dict[str, object]] = []
    for index in range(num_groups):
        raw = dict(zip(names, values[index * len(names):(index + 1) * len(names)], strict=True))
        group: dict[str, object] = {
            name: bool(value) if name in booleans else value for name, value in raw.items()
        }
        if kind != "sgd":
            group["betas"] = (group.pop("beta1"), group.pop("beta2"))
            decoupled = group.pop("decoupled_weight_decay")
            group["decoupled_weight_decay"] = None if decoupled < 0 else bool(decoupled)
        group["foreach"] = None
        group["fused"] = None
        groups.append(group)
    return groups
