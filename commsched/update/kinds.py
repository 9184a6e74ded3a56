"""Which torch.optim classes commsched can update bucket by bucket, and their hyper-parameters.

The one table of optimizer kinds: the per-bucket updater, the parameter
servers and the wire encoding of hyper-parameters all read it.
"""

from __future__ import annotations

import torch

_KINDS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}
_HYPERPARAMETERS = {
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
    "adam": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay"),
}
_HYPERPARAMETERS["adamw"] = _HYPERPARAMETERS["adam"]

Hyperparameters = list[dict[str, object]]
"""Per param group, the optimizer's hyper-parameters (taken at ``step()``)."""


USER_CLASS_ATTRIBUTE = "_commsched_user_class"
"""Set on the class that `commsched.prepare` mixes into a prepared object: the user's own class."""


def user_class(optimizer: torch.optim.Optimizer) -> type:
    """The optimizer's own class, behind commsched's mixin once prepared."""
    cls = type(optimizer)
    return getattr(cls, USER_CLASS_ATTRIBUTE, cls)


def unsupported_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot be updated bucket by bucket, or None if it can."""
    kind = _KINDS.get(user_class(optimizer))
    if kind is None:
        return (
            f"{user_class(optimizer).__name__} has no per-bucket update (only torch.optim.SGD, Adam "
            "and AdamW do); it steps as usual once every reduction is done"
        )
    for index, group in enumerate(optimizer.param_groups):
        for option in ("differentiable", "capturable"):
            if group.get(option):
                return f"param_groups[{index}] sets {option}=True, which per-bucket updates do not support"
        if any(torch.is_complex(p) for p in group["params"]):
            return f"param_groups[{index}] holds complex parameters"
    return None


def hyperparameter_snapshot(optimizer: torch.optim.Optimizer, kind: str) -> Hyperparameters:
    """The hyper-parameters of every param group of ``optimizer`` now, with the group's own
    ``foreach`` and ``fused`` exactly as torch.optim's ``step()`` passes them (None lets
    torch pick; an explicit False is kept, since torch treats it differently from None).

    Tensor values (``lr=torch.tensor(0.1)``, tensor betas) are copied: an LR scheduler
    changes such a tensor in place, and an update applied after ``step()`` returned
    (forward overlap) must use the value ``step()`` saw."""
    keys = _HYPERPARAMETERS[kind]
    return [{k: _frozen(group.get(k)) for k in keys} | {"foreach": group.get("foreach"), "fused": group.get("fused")}
            for group in optimizer.param_groups]


def _frozen(value: object) -> object:
    """``value`` as it is now: tensors (also inside tuples) copied, everything else as is."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(_frozen(v) for v in value)
    return value


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """``"sgd"``, ``"adam"`` or ``"adamw"``; raises ValueError for any other optimizer."""
    reason = unsupported_reason(optimizer)
    if reason is not None:
        raise ValueError(reason)
    return _KINDS[user_class(optimizer)]


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
