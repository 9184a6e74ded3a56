"""The harness itself: results come back, and every kind of failure is reported, not hung."""

from __future__ import annotations

import _thread
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.overrides import _get_current_function_mode_stack

from commsched.testing import RanksFailed, run_ranks

pytestmark = pytest.mark.distributed


def sum_of_ranks(rank: int, world_size: int, scale: int) -> int:
    t = torch.tensor([rank * scale])
    dist.all_reduce(t)
    return int(t)


def rank1_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")


def rank0_hangs(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(600)


def rank1_dies(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)


def rank1_aborts_at_exit(rank: int, world_size: int) -> None:
    """Reports success, then aborts while the interpreter shuts down, a thread still asleep."""
    import atexit
    import threading

    if rank == 1:
        threading.Thread(target=a_thread_still_running_at_exit, daemon=True).start()
        atexit.register(os.abort)


def a_thread_still_running_at_exit() -> None:
    time.sleep(600)


def rank1_leaves_a_thread_running(rank: int, world_size: int) -> None:
    import threading

    if rank == 1:
        threading.Thread(target=a_thread_still_running_at_exit, name="left behind", daemon=True).start()


def rank1_has_a_thread_python_did_not_start(rank: int, world_size: int) -> str:
    """As autograd's CUDA device thread that ran a hook which logged: a foreign thread that asked
    for its ``threading`` object, so shows in ``threading.enumerate()``, and then waits outside
    the interpreter for work that never comes."""
    if rank == 1:
        seen = threading.Event()
        never_released = _thread.allocate_lock()
        never_released.acquire()

        def foreign() -> None:
            threading.current_thread()
            seen.set()
            never_released.acquire()

        _thread.start_new_thread(foreign, ())
        assert seen.wait(30)
        assert any(isinstance(thread, threading._DummyThread) for thread in threading.enumerate())
    return "done"


KEPT_POOLS: list = []
"""Thread pools a rank keeps for good, as torch keeps the one that prefetches its cache key."""


def rank1_keeps_a_thread_pool(rank: int, world_size: int) -> str:
    """Its idle workers are alive at exit, as at a script's end, which shuts the pool down itself."""
    from concurrent.futures import ThreadPoolExecutor

    if rank == 1:
        pool = ThreadPoolExecutor(max_workers=2)
        KEPT_POOLS.append(pool)
        assert [f.result() for f in [pool.submit(int, "1"), pool.submit(int, "2")]] == [1, 2]
        assert sum(thread.name.startswith("ThreadPoolExecutor") for thread in threading.enumerate()) >= 1
    return "done"


def watch_left_by_a_case(rank: int, world_size: int) -> tuple[int, int]:
    """A case that drops its model within warm-up leaves its read watch on the stack; the next
    case starts without it."""
    import commsched
    from commsched.testing import run_subtests

    def one_step_then_drop() -> None:
        model = torch.nn.Linear(4, 4)
        model, optimizer = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        left.append(len(_get_current_function_mode_stack()))

    left: list[int] = []
    run_subtests({"one step, then dropped": one_step_then_drop,
                  "the next case": lambda: left.append(len(_get_current_function_mode_stack()))})
    return left[0], left[1]


GLOO_THREADS_END_WITHIN_S = 5.0


def gloo_threads_after_destroy(rank: int, world_size: int) -> list[str]:
    """An optimizer's step (which imports torch._dynamo), then the group destroyed: its threads must go."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    dist.all_reduce(torch.ones(2))
    dist.destroy_process_group()
    # Freed while the rank runs, not at the interpreter's finalization: gloo's loop thread may take
    # a moment to end once destroy_process_group() returns (seen once, on a loaded machine).
    deadline = time.monotonic() + GLOO_THREADS_END_WITHIN_S
    while (left := _gloo_threads()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _gloo_threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except FileNotFoundError:  # the thread ended as we read
            continue
    return [name for name in names if "gloo" in name]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names in /proc/self/task (Linux)")
def test_destroying_the_group_frees_it_while_the_rank_runs():
    """See [Note: the world group outlives destroy_process_group] in commsched/testing/launch.py."""
    assert run_ranks(gloo_threads_after_destroy, 2, timeout_s=120) == [[], []]


def test_results_come_back_in_rank_order():
    assert run_ranks(sum_of_ranks, 3, 10, timeout_s=60) == [30, 30, 30]


def test_a_raising_rank_is_reported_with_its_traceback():
    with pytest.raises(RanksFailed, match=r"(?s)1 of 2 ranks failed.*rank 1.*deliberate failure on rank 1"):
        run_ranks(rank1_raises, 2, timeout_s=60)


def test_a_hanging_rank_is_killed_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(RanksFailed, match=r"(?s)rank 0 -----\ndid not finish within the time limit"):
        run_ranks(rank0_hangs, 2, timeout_s=8)
    assert time.monotonic() - start < 30


def test_a_case_starts_without_the_watches_the_case_before_left():
    assert run_ranks(watch_left_by_a_case, 2, timeout_s=60) == [(1, 0), (1, 0)]


def test_a_dying_rank_is_reported():
    with pytest.raises(RanksFailed, match=r"(?s)rank 1 -----\nprocess exited with code 3"):
        run_ranks(rank1_dies, 2, timeout_s=60)


def test_a_rank_that_crashes_after_reporting_is_reported_with_its_threads():
    with pytest.raises(RanksFailed, match=r"(?s)rank 1 -----\nreported success, then exited with code -6 .*"
                                          r"its threads when it crashed.*a_thread_still_running_at_exit"):
        run_ranks(rank1_aborts_at_exit, 2, timeout_s=60)


def test_a_rank_that_leaves_a_thread_running_at_exit_is_reported():
    """[Note: ranks end as a script ends]: that thread would have met the interpreter's finalization."""
    with pytest.raises(RanksFailed, match=r"(?s)rank 1 -----\nreported success, then left threads running at "
                                          r"exit.*threads still running after the exit handlers: left behind"):
        run_ranks(rank1_leaves_a_thread_running, 2, timeout_s=60)


def test_the_idle_workers_of_a_thread_pool_kept_to_the_end_are_not_reported_at_exit():
    """[Note: ranks end as a script ends]: a script's end shuts thread pools down before finalization."""
    assert run_ranks(rank1_keeps_a_thread_pool, 2, timeout_s=60) == ["done", "done"]


def test_a_thread_python_did_not_start_is_not_reported_at_exit():
    """[Note: ranks end as a script ends]: such threads wait in C++, not in the interpreter."""
    assert run_ranks(rank1_has_a_thread_python_did_not_start, 2, timeout_s=60) == ["done", "done"]
