"""The module tree and its trainable parameters as they were at ``prepare()``, checked at each forward pass."""

from __future__ import annotations

import torch

_Described = tuple[int, bool, tuple[int, ...], torch.dtype, torch.device]


class ParameterFingerprint:
    """The trainable parameters as they were at ``prepare()``, and the module tree holding them.

    Buckets are built for those parameters, in their dtype and on their device:
    a parameter added, removed, replaced, frozen, resized or converted
    (``model.to(torch.float64)``, ``.half()``, ``.to(device)``) afterwards would
    silently be left out or mis-reduced, so each forward pass checks the cheap
    fingerprint and, on a change, explains it by name. A change of the tree that
    leaves every parameter as it was (a parameter-free module added, say) is
    accepted: nothing commsched built depends on it.
    """

    def __init__(self, root: torch.nn.Module):
        self._root = root
        self._described = self._describe()
        self._accept_tree()

    @property
    def modules(self) -> list[torch.nn.Module]:
        """Every module of the tree as last checked (buffers are broadcast from these)."""
        return self._modules

    def check(self) -> None:
        if self._take() == self._fingerprint:
            return
        if self._describe() != self._described:
            raise RuntimeError(self._explain())
        holding = self._new_modules_holding_parameters()
        if holding:
            raise RuntimeError(
                f"module(s) {', '.join(map(repr, holding))} were added to the model after commsched.prepare() "
                "and hold some of its parameters: the forward pass may now reach them before the gates "
                "that wait for their updates. Add modules that hold or share parameters before "
                "calling commsched.prepare()."
            )
        self._accept_tree()

    def _new_modules_holding_parameters(self) -> list[str]:
        """Modules added since the last check whose subtree holds a parameter (tied, or a
        module of the model wrapped in a new one)."""
        known = {id(m) for m in self._modules}
        return [name for name, module in self._root.named_modules()
                if id(module) not in known and next(module.parameters(), None) is not None]

    def _accept_tree(self) -> None:
        self._modules = list(self._root.modules())
        self._fingerprint = self._take()

    def _take(self) -> list[object]:
        fingerprint: list[object] = []
        for module in self._modules:
            fingerprint.extend(map(id, module._modules.values()))
            for param in module._parameters.values():
                if param is None:
                    fingerprint.append(None)
                else:
                    fingerprint.append((id(param), param.requires_grad, param.shape, param.dtype, param.device))
        return fingerprint

    def _describe(self) -> dict[str, _Described]:
        return {name: (id(p), p.requires_grad, tuple(p.shape), p.dtype, p.device)
                for name, p in self._root.named_parameters()}

    def _explain(self) -> str:
        before, now = self._described, self._describe()
        changes = [f"'{n}' was added" for n in now if n not in before]
        changes += [f"'{n}' was removed" for n in before if n not in now]
        converted = False
        for name in before.keys() & now.keys():
            (old_id, old_grad, old_shape, old_dtype, old_device) = before[name]
            (new_id, new_grad, new_shape, new_dtype, new_device) = now[name]
            if old_id != new_id:
                changes.append(f"'{name}' was replaced by a new Parameter")
            elif old_grad != new_grad:
                changes.append(f"'{name}' changed requires_grad from {old_grad} to {new_grad}")
            elif old_shape != new_shape:
                changes.append(f"'{name}' changed shape from {old_shape} to {new_shape}")
            elif old_dtype != new_dtype:
                changes.append(f"'{name}' changed dtype from {old_dtype} to {new_dtype}")
                converted = True
            elif old_device != new_device:
                changes.append(f"'{name}' moved from {old_device} to {new_device}")
                converted = True
        shown = sorted(changes)
        listed = "; ".join(shown[:8]) + (f"; and {len(shown) - 8} more" if len(shown) > 8 else "")
        fix = (
            "Convert or move the model (model.to(dtype or device), .half(), .double(), .cuda()) before "
            "calling commsched.prepare(), and build the optimizer on the converted parameters; for mixed "
            "precision keep the parameters as they are and use torch.autocast."
            if converted else
            "Make every change (adding, removing, replacing, freezing or resizing parameters) before "
            "calling commsched.prepare()."
        )
        return (
            f"the model's parameters changed after commsched.prepare(): {listed}. Gradient buckets are "
            f"built once, at prepare(), for the parameters as they were then. {fix}"
        )
