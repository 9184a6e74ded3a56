"""Many tests' rank functions in one group of spawned ranks, each test still told its own outcome.

A spawned rank costs seconds before it runs anything (a fresh interpreter imports torch,
then torch._dynamo), so a suite that spawns once per test spends much of its time
starting processes. `run_groups` spawns once for many named groups: every rank runs them
one after the other, and each group's outcome comes back on its own, so a failure is
reported by the test it belongs to and the other tests still pass:

    outcomes = run_groups({"parity": Group(parity_grid, timeout_s=300),
                           "copies": Group(copies, timeout_s=240)}, world_size=2)
    outcomes["copies"].result()  # each rank's return value, or RanksFailed with every failing rank's traceback

Each group starts as a fresh rank would (torch's random generator at its initial seed), and
runs under its own timeout: a rank that overruns it prints its stacks and exits, so a hang
fails its own group. A group that fails on any rank ends the spawn (it may have left the
process group out of step), and the groups after it run in a new one; so do the groups
after one that kills or stalls its rank, or that ends its spawn (``Group(ends_spawn=True)``).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from commsched.testing.launch import RanksFailed, rank_store, run_ranks
from commsched.testing.subtests import end_leftover_watches

SPAWN_MARGIN_S = 60.0
"""On top of the groups' own timeouts: starting the ranks, and their exit."""


@dataclass(frozen=True)
class Group:
    """``fn(rank, world_size, *args)`` on every rank, within ``timeout_s``."""

    fn: Callable[..., Any]
    args: tuple = ()
    timeout_s: float = 180.0
    ends_spawn: bool = False
    """The ranks exit right after it, without waiting for each other: for a group that leaves
    the process group unusable (a rank that stops taking part) or needs its ranks to end."""


@dataclass(frozen=True)
class GroupOutcome:
    values: tuple | None
    """Each rank's return value, in rank order (None: it failed)."""
    report: str | None
    """What failed, on which rank (None: it passed on every rank)."""
    seconds: float | None = None
    """How long the group ran, on its slowest rank (None where it did not end on every rank)."""

    def result(self) -> list[Any]:
        """Each rank's return value; `RanksFailed` with the report if the group failed."""
        if self.report is not None:
            raise RanksFailed(self.report)
        return list(self.values or ())


def run_groups(groups: Mapping[str, Group], world_size: int, **run_ranks_options: Any) -> dict[str, GroupOutcome]:
    """Run every group on ``world_size`` ranks, in order, in as few spawns as their outcomes allow.

    ``run_ranks_options``: `run_ranks`'s own (``collective_timeout_s``, ``env``, ...), the
    same for every group; its ``timeout_s`` is the groups' timeouts together.
    """
    outcomes: dict[str, GroupOutcome] = {}
    pending = list(groups.items())
    while pending:
        with tempfile.TemporaryDirectory(prefix="commsched-groups-") as directory:
            timeout_s = sum(group.timeout_s for _, group in pending) + SPAWN_MARGIN_S
            try:
                run_ranks(_run_in_turn, world_size, pending, directory, timeout_s=timeout_s, **run_ranks_options)
                failure = None
            except RanksFailed as error:
                failure = str(error) + _stacks(directory, world_size)
            progress = [_load(directory, rank) for rank in range(world_size)]
        finished = 0
        while finished < len(pending) and all(pending[finished][0] in done for _, done in progress):
            name = pending[finished][0]
            outcomes[name] = _combine([done[name] for _, done in progress])
            finished += 1
        if failure is not None:
            if finished == len(pending):
                # Every group ran; the ranks failed afterwards (e.g. crashed while exiting): any group may be why.
                for name, _ in pending:
                    previous = outcomes[name].report
                    outcomes[name] = GroupOutcome(None, (previous + "\n" if previous else "") + (
                        f"the ranks failed after running this group and {len(pending) - 1} others:\n{failure}"))
            elif not any(started for started, _ in progress):
                for name, _ in pending:  # before any group began: the spawn itself failed
                    outcomes[name] = GroupOutcome(None, failure)
                finished = len(pending)
            else:
                outcomes[pending[finished][0]] = GroupOutcome(None, failure)
                finished += 1
        pending = pending[finished:]
    return outcomes


def _combine(per_rank: list[tuple[bool, Any, float]]) -> GroupOutcome:
    seconds = max(took for _, _, took in per_rank)
    failures = {rank: payload for rank, (ok, payload, _) in enumerate(per_rank) if not ok}
    if failures:
        report = "\n".join(f"----- rank {rank} -----\n{text}" for rank, text in sorted(failures.items()))
        return GroupOutcome(None, f"{len(failures)} of {len(per_rank)} ranks failed:\n{report}", seconds)
    return GroupOutcome(tuple(payload for _, payload, _ in per_rank), None, seconds)


def _run_in_turn(rank: int, world_size: int, groups: list[tuple[str, Group]], directory: str) -> None:
    store = rank_store()
    fresh_seed = torch.initial_seed()
    done: dict[str, tuple[bool, Any, float]] = {}
    with open(os.path.join(directory, f"stacks-{rank}.txt"), "w") as stacks:
        for index, (name, group) in enumerate(groups):
            _save(directory, rank, True, done)
            torch.manual_seed(fresh_seed)
            faulthandler.dump_traceback_later(group.timeout_s, exit=True, file=stacks)
            started = time.perf_counter()
            try:
                outcome = (True, group.fn(rank, world_size, *group.args))
            except BaseException:  # noqa: BLE001 - reported as this group's failure
                outcome = (False, traceback.format_exc())
            finally:
                faulthandler.cancel_dump_traceback_later()
                end_leftover_watches()
            done[name] = (*outcome, time.perf_counter() - started)
            ok = _save(directory, rank, True, done)
            if group.ends_spawn:
                return
            # Every rank finishes the group before any starts the next (through the store: the
            # process group may be out of step after a failure), and all stop if one failed.
            keys = [f"commsched.testing.groups/{index}/{r}" for r in range(world_size)]
            store.set(keys[rank], "1" if ok else "0")
            store.wait(keys, datetime.timedelta(seconds=group.timeout_s))
            if any(store.get(key) != b"1" for key in keys):
                return


def _save(directory: str, rank: int, started: bool, done: dict[str, tuple[bool, Any, float]]) -> bool:
    """Write what this rank has finished; False if the last outcome is a failure (or cannot be sent)."""
    name = next(reversed(done), None)
    try:
        data = pickle.dumps((started, done))
    except Exception:  # noqa: BLE001 - the last group's value cannot travel: its failure
        done[name] = (False, f"its return value cannot be pickled:\n{traceback.format_exc()}", done[name][2])
        data = pickle.dumps((started, done))
    path = os.path.join(directory, f"progress-{rank}.pkl")
    with open(path + ".tmp", "wb") as file:
        file.write(data)
    os.replace(path + ".tmp", path)
    return name is None or done[name][0]


def _load(directory: str, rank: int) -> tuple[bool, dict[str, tuple[bool, Any, float]]]:
    path = os.path.join(directory, f"progress-{rank}.pkl")
    if not os.path.exists(path):
        return False, {}
    with open(path, "rb") as file:
        return pickle.load(file)


def _stacks(directory: str, world_size: int) -> str:
    """The stacks of the ranks that overran a group's timeout."""
    text = []
    for rank in range(world_size):
        path = os.path.join(directory, f"stacks-{rank}.txt")
        if os.path.exists(path) and os.path.getsize(path):
            with open(path) as file:
                text.append(f"\n----- rank {rank} overran its group's timeout; its threads then -----\n{file.read()}")
    return "".join(text)
