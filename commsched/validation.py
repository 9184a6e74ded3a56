"""The checks the configuration dataclasses run on their fields (`commsched.Strategy`, its backends).

Each raises ``ValueError`` naming the field, the value it got and what is allowed.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch


def check_servers(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_staleness(name: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be None or an integer >= 0, got {value!r}")


@dataclass(frozen=True)
class Range:
    low: float
    high: float
    text: str
    """The range as a reader wants it, with the unit."""


def check_in_range(
    name: str, value: object, allowed: Range, optional: bool = False, owner: str = "Strategy"
) -> None:
    if optional and value is None:
        return
    none = "None or " if optional else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "a number or None" if optional else "a number"
        raise ValueError(
            f"{owner}.{name} must be {kind}, got {value!r} ({type(value).__name__}); allowed: {none}{allowed.text}"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{owner}.{name} must be {none}finite and greater than 0, got {value!r}; allowed: {none}{allowed.text}"
        )
    if not allowed.low <= value <= allowed.high:
        raise ValueError(f"{owner}.{name} must be {none}from {allowed.text}, got {value!r}")


def check_directory(name: str, value: object) -> None:
    """None, or a path that names a directory: a non-empty ``str`` or ``os.PathLike`` of one."""
    if value is None:
        return
    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(path, str) or not path.strip() or "\0" in path:
        why = "; an empty path would write into the working directory" if path == "" else ""
        raise ValueError(
            f"Strategy.{name} must be None or a directory path (a str or os.PathLike, not blank, without NUL), "
            f"got {value!r} ({type(value).__name__}){why}"
        )


def check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"Strategy.{name} must be an integer from {low} to {high}, got {value!r}")


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(
            f"Strategy.{name} must be True or False, got {value!r} ({type(value).__name__})"
        )


def check_dtype(name: str, value: object, allowed: tuple[torch.dtype, ...]) -> None:
    """None, or one of ``allowed``: a ``torch.dtype`` itself (``"bfloat16"`` is refused, naming
    ``torch.bfloat16``), so that a value compares equal on every rank and prints as torch prints it."""
    if value is None or (isinstance(value, torch.dtype) and value in allowed):
        return
    meant = getattr(torch, value.removeprefix("torch."), None) if isinstance(value, str) else None
    hint = f"; write {meant} (a torch.dtype, not a string)" if meant in allowed else ""
    names = ", ".join(map(str, allowed))
    raise ValueError(f"Strategy.{name} must be None or one of {names}, got {value!r} ({type(value).__name__}){hint}")
