"""Tests whose ranks run in one spawn shared with every other selected test of the same world size.

Spawning ranks costs seconds per test (each fresh interpreter imports torch); a test marked

    @in_shared_ranks(copies, 2, timeout_s=240)
    def test_copies_of_a_prepared_model(shared_ranks):
        shared_ranks.result()  # each rank's return value, or RanksFailed with the failing ranks' tracebacks

has ``copies(rank, world_size)`` run in a spawn shared with the other selected tests marked
for 2 ranks (see `commsched.testing.groups`), at the first of them that runs; each test
still passes or fails on its own group's outcome. Only tests that leave their ranks fit
for the next group belong here: a test that kills a rank, stalls it, or leaves the world
group's collectives unmatched spawns its own.

pytest is imported only by the functions that use it, so importing this module needs none;
the fixtures (``shared_spawns``, ``shared_ranks``) and the marker's registration live in
tests/conftest.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from commsched.testing.groups import Group, GroupOutcome, run_groups

if TYPE_CHECKING:
    import pytest

MARKER = "shared_ranks"


def in_shared_ranks(fn, world_size: int, *args: Any, timeout_s: float, tmp_dir: bool = False, last: bool = False):
    """Mark a test whose ranks run ``fn(rank, world_size, *args)`` in the shared spawn of ``world_size`` ranks.

    ``timeout_s``: for ``fn`` alone. ``tmp_dir``: ``fn`` also gets a fresh directory of its
    own (last argument), which the test finds at ``shared_ranks.path``. ``last``: ``fn``
    leaves the world group's collectives unmatched (or a rank gone), so it runs after every
    other group, and its ranks exit right after it (a second such group spawns anew).
    """
    import pytest

    return pytest.mark.shared_ranks(Group(fn, args, timeout_s, ends_spawn=last), world_size=world_size,
                                    tmp_dir=tmp_dir)


@dataclass(frozen=True)
class SharedResult:
    outcome: GroupOutcome
    path: Path | None

    def result(self) -> list[Any]:
        return self.outcome.result()


def _spec(item: pytest.Item) -> tuple[str, Group, int, bool] | None:
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return None
    group: Group = marker.args[0]
    world_size = marker.kwargs["world_size"]
    tmp_dir = marker.kwargs["tmp_dir"]
    key = f"{group.fn.__module__}.{group.fn.__qualname__}{group.args!r} on {world_size} ranks" + (
        ", with a directory" if tmp_dir else "")
    return key, group, world_size, tmp_dir


class SharedSpawns:
    """The session's shared spawns: one per world size, started by the first test that needs it."""

    def __init__(self, session: pytest.Session, tmp_path_factory: pytest.TempPathFactory):
        self.session = session
        self.tmp_path_factory = tmp_path_factory
        self.outcomes: dict[str, GroupOutcome] = {}
        self.paths: dict[str, Path] = {}

    def result_of(self, item: pytest.Item) -> SharedResult:
        spec = _spec(item)
        if spec is None:
            import pytest

            raise pytest.UsageError(f"{item.nodeid} uses the shared_ranks fixture without @in_shared_ranks(...)")
        key, _, world_size, _ = spec
        if key not in self.outcomes:
            self._run(world_size)
        return SharedResult(self.outcomes[key], self.paths.get(key))

    def _run(self, world_size: int) -> None:
        groups: dict[str, Group] = {}
        for item in self.session.items:
            spec = _spec(item)
            if spec is None or spec[2] != world_size or spec[0] in self.outcomes or spec[0] in groups:
                continue
            key, group, _, tmp_dir = spec
            if tmp_dir:
                self.paths[key] = self.tmp_path_factory.mktemp("shared-ranks")
                group = Group(group.fn, (*group.args, str(self.paths[key])), group.timeout_s, group.ends_spawn)
            groups[key] = group
        groups = dict(sorted(groups.items(), key=lambda entry: entry[1].ends_spawn))  # those that end a spawn last
        try:
            self.outcomes.update(run_groups(groups, world_size))
        except BaseException as error:  # e.g. pytest-timeout: no later test may start the spawn again
            for key in groups:
                self.outcomes.setdefault(key, GroupOutcome(None, f"the shared spawn was interrupted: {error!r}"))
            raise


def slowest_groups(outcomes: dict[str, GroupOutcome], count: int) -> list[str]:
    """Lines for pytest's ``--durations``: a shared spawn's time is charged to the test that started
    it, so the groups' own times say which tests the spawns spend it on."""
    timed = sorted(((o.seconds, key) for key, o in outcomes.items() if o.seconds is not None), reverse=True)
    return [f"{seconds:8.2f}s {key}" for seconds, key in (timed[:count] if count else timed)]
