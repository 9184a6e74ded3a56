"""The module tree and its trainable parameters as they were at ``prepare()``, checked at each forward pass."""

from __future__ import annotations

import torch


class ParameterFingerprint:
    """The module tree and its trainable parameters as they were at ``prepare()``.

    Buckets are built for those parameters only: a parameter added, removed,
    replaced, frozen or resized afterwards would silently be left out or
    mis-reduced, so each forward pass checks the cheap fingerprint and, on a
    change, explains it by name.
    """

    def __init__(self, root: torch.nn.Module):
        self._root = root
        self._modules = list(root.modules())
        self._fingerprint = self._take()
        self._described = self._describe()

    def check(self) -> None:
        if self._take() != self._fingerprint:
            raise RuntimeError(self._explain())

    def _take(self) -> list[object]:
        fingerprint: list[object] = []
        for module in self._modules:
            fingerprint.extend(map(id, module._modules.values()))
            for param in module._parameters.values():
                if param is None:
                    fingerprint.append(None)
                else:
                    fingerprint.append((id(param), param.requires_grad, param.shape))
        return fingerprint

    def _describe(self) -> dict[str, tuple[int, bool, tuple[int, ...]]]:
        return {name: (id(p), p.requires_grad, tuple(p.shape)) for name, p in self._root.named_parameters()}

    def _explain(self) -> str:
        before, now = self._described, self._describe()
        changes = [f"'{n}' was added" for n in now if n not in before]
        changes += [f"'{n}' was removed" for n in before if n not in now]
        for name in before.keys() & now.keys():
            (old_id, old_grad, old_shape), (new_id, new_grad, new_shape) = before[name], now[name]
            if old_id != new_id:
                changes.append(f"'{name}' was replaced by a new Parameter")
            elif old_grad != new_grad:
                changes.append(f"'{name}' changed requires_grad from {old_grad} to {new_grad}")
            elif old_shape != new_shape:
                changes.append(f"'{name}' changed shape from {old_shape} to {new_shape}")
        if not changes:
            changes.append("a submodule was added, removed or replaced")
        return (
            "the model's parameters changed after commsched.prepare(): "
            + "; ".join(sorted(changes))
            + ". Gradient buckets are built once, at prepare(); make every change "
            "(adding, removing, replacing, freezing or resizing parameters) before "
            "calling commsched.prepare()."
        )
