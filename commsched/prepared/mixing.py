"""The classes `commsched.prepare` gives the user's objects: the user's class with a commsched mixin in front."""

from __future__ import annotations

from commsched.update.kinds import USER_CLASS_ATTRIBUTE

_MIXED_CLASSES: dict[tuple[type, type], type] = {}


def mixed_class(mixin: type, cls: type, *, keep_name: bool = False) -> type:
    """``cls`` with ``mixin``'s behaviour first, made once per pair, named ``Commsched<cls>``
    (``keep_name``: as ``cls``). The class records ``cls`` as the user's."""
    mixed = _MIXED_CLASSES.get((mixin, cls))
    if mixed is None:
        namespace = {"__module__": cls.__module__, USER_CLASS_ATTRIBUTE: cls}
        if keep_name:
            namespace["__qualname__"] = cls.__qualname__
        mixed = type(cls.__name__ if keep_name else f"Commsched{cls.__name__}", (mixin, cls), namespace)
        _MIXED_CLASSES[(mixin, cls)] = mixed
    return mixed


def mix_in(obj: object, mixin: type) -> None:
    """Give ``obj`` the behaviour of ``mixin`` while keeping its class's own."""
    obj.__class__ = mixed_class(mixin, type(obj))
