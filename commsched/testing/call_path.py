"""Which of commsched's files a gradient and a parameter pass through: a trace of the calls.

`docs/architecture.md` writes down the gradient's way from its hook to its
update and the parameter's way from ``step()`` to the next forward pass; this
traces one real iteration (after warm-up, forward overlap on, two gloo ranks)
so that what the page says can be checked against the code, and counted:

    python -m commsched.testing.call_path          # about 10 seconds

Each call into commsched's package on the training thread is grouped under its
*entry*: the outermost commsched function on the stack, called from torch or
from the loop (a gradient hook, the end-of-backward callback, ``step()``, the
root's forward pre-hook, a module's gate). A file is *entered* each time a
call comes into it from another file. Communication threads (gloo's completion
callbacks) are not traced: they return credit and issue more partitions, in
files the training thread's way already enters.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import torch

PACKAGE = Path(__file__).resolve().parents[1]
"""The commsched package whose files are counted: the one this module belongs to."""

@dataclass
class Way:
    """The files one entry's calls went through, in the order first entered, and how often each was entered."""

    files: list[str] = field(default_factory=list)
    entered: Counter[str] = field(default_factory=Counter)
    calls: list[str] = field(default_factory=list)
    """Each call that entered a file, as ``file:function``, in order."""

    def add(self, other: Way) -> None:
        for name in other.files:
            if name not in self.files:
                self.files.append(name)
        self.entered.update(other.entered)
        self.calls.extend(other.calls)

    def describe(self) -> str:
        return ", ".join(f"{name} ({self.entered[name]}x)" for name in self.files)


def _relative(filename: str) -> str | None:
    path = Path(filename)
    try:
        return str(path.resolve().relative_to(PACKAGE))
    except ValueError:
        return None


ENTRY_NAMES = {
    ("engine/hooks.py", "on_gradient_accumulated"): "gradient hook",
    ("engine/hooks.py", "on_output_gradient"): "backward start",
    ("engine/hooks.py", "_before_forward"): "forward start",
    ("engine/hooks.py", "_arm_backward_start"): "forward end",
    ("engine/reducer.py", "_end_backward"): "end of backward",
    ("engine/hooks.py", "gate"): "gate",
    ("prepared/optimizer.py", "step"): "step",
    ("prepared/optimizer.py", "zero_grad"): "zero_grad",
}
"""Where torch or the loop calls into commsched during an iteration, by file and function."""


def _entry_name(relative: str, function: str) -> str:
    return ENTRY_NAMES.get((relative, function), f"{relative}:{function}")


@contextmanager
def traced(ways: dict[str, list[Way]]) -> Iterator[None]:
    """Record, per entry and per call of it, the commsched files the calls on this thread go through."""
    current: list[tuple[str, Way] | None] = []
    """Per frame on the stack, the innermost commsched file and way at or below it (None: none yet)."""

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "return":
            if current:
                current.pop()
            return
        if event != "call":
            return
        relative = _relative(frame.f_code.co_filename)
        caller = current[-1] if current else None
        if relative is None or relative.startswith(("testing/", "bench/")):
            current.append(caller)
            return
        caller_file = None if caller is None else caller[0]
        if caller is None:
            way = Way()
            ways.setdefault(_entry_name(relative, frame.f_code.co_name), []).append(way)
        else:
            way = caller[1]
        if relative not in way.files:
            way.files.append(relative)
        if caller_file != relative:
            way.entered[relative] += 1
            way.calls.append(f"{relative}:{frame.f_code.co_name}")
        current.append((relative, way))

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)
    )


def _run(rank: int, world_size: int, iterations_before: int
         ) -> dict[str, list[tuple[list[str], dict[str, int], list[str]]]]:
    import commsched

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = commsched.prepare(model, optimizer, commsched.Strategy(bucket_cap_mb=0.01))
    generator = torch.Generator().manual_seed(rank)

    def batch() -> torch.Tensor:
        return torch.randn(16, 32, generator=generator)

    for _ in range(iterations_before):
        model(batch()).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    loss = model(batch()).square().mean()
    ways: dict[str, list[Way]] = {}
    with traced(ways):
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        output = model(batch())
    output.sum().item()
    commsched.release(model)
    return {name: [(way.files, dict(way.entered), way.calls) for way in calls] for name, calls in ways.items()}


def _first(calls: list[Way], holding: str | None = None) -> Way:
    """The first call (whose way went through ``holding``); an empty way if there is none."""
    return next((way for way in calls if holding is None or holding in way.files), Way())


def gradient_way(traced_ways: dict[str, list[Way]]) -> Way:
    """One gradient's way: its hook (the pass's last, which completes the input-side bucket; the
    first also begins the pass), the end of backward, which issues what the plan holds, and the gate
    that waits for and updates it."""
    way = Way()
    for part in (traced_ways.get("gradient hook", [Way()])[-1], _first(traced_ways.get("end of backward", [])),
                 _first(traced_ways.get("gate", []), UPDATES)):
        way.add(part)
    return way


def parameter_way(traced_ways: dict[str, list[Way]]) -> Way:
    """One parameter's way: ``step()``, the next forward pass's start, and the gate that updates it."""
    way = Way()
    for part in (_first(traced_ways.get("step", [])), _first(traced_ways.get("forward start", [])),
                 _first(traced_ways.get("gate", []), UPDATES)):
        way.add(part)
    return way


SOMETIMES = frozenset({"engine/completion.py"})
"""Files a way enters only when timing makes it: a reduction that completes while the dispatcher
is still issuing runs its callback inline, on the training thread."""

UPDATES = "update/fused.py"
"""A gate whose way reaches the fused kernels updated a bucket."""


def trace(iterations_before: int = 6, timeout_s: float = 120.0) -> dict[str, list[Way]]:
    """Rank 0's ways through one iteration of two gloo ranks on this machine, per entry and call."""
    from commsched.testing.launch import run_ranks

    results = run_ranks(_run, 2, iterations_before, timeout_s=timeout_s)
    return {name: [Way(files, Counter(entered), entries) for files, entered, entries in calls]
            for name, calls in results[0].items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations-before", type=int, default=6,
                        help="iterations trained before the traced one (warm-up is 3)")
    parser.add_argument("--calls", action="store_true", help="also list each call that entered a file")
    arguments = parser.parse_args(argv)
    ways = trace(arguments.iterations_before)
    for name, calls in ways.items():
        for number, way in enumerate(calls):
            print(f"{name} #{number}: {len(way.files)} files: {way.describe()}")
    for title, way in (("gradient", gradient_way(ways)), ("parameter", parameter_way(ways))):
        print(f"the {title}'s way: {len(way.files)} files, {sum(way.entered.values())} entries: {way.describe()}")
        if arguments.calls:
            print("  " + "\n  ".join(way.calls))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
