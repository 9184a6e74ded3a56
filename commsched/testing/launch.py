"""Run a function on N local processes joined by a gloo process group on 127.0.0.1.

The demo, the benchmarks and the tests all start their ranks this way, and so
can anyone testing code built on commsched:

    results = run_ranks(check_something, world_size=3, timeout_s=120)

``fn(rank, world_size, *args)`` runs in each rank's process after
``init_process_group("gloo")``; its return values come back in rank order. A
rank that raises, dies or overruns makes `run_ranks` raise `RanksFailed` with
every rank's traceback, instead of hanging the caller; so does one that crashes
as it ends (with its threads' stacks) or leaves a thread running after its exit
handlers (see [Note: ranks end as a script ends]).
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import importlib
import os
import queue
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GRACE_AFTER_FAILURE_S = 15.0
"""How long the other ranks get to report after one rank failed (they usually fail
too, quickly, once their peer's sockets close)."""


EXIT_GRACE_S = 30.0
"""How long ranks that reported success get to exit before it counts as a failure."""


class RanksFailed(AssertionError):
    """One or more ranks raised, died or did not finish in time."""


_rank_store: dist.TCPStore | None = None
"""In a rank: the job's store (a client of the parent's), for helpers that synchronise ranks
without the process group (see `commsched.testing.groups`)."""


def rank_store() -> dist.TCPStore:
    """The job's store, in a rank `run_ranks` started."""
    if _rank_store is None:
        raise RuntimeError("rank_store() is for the ranks run_ranks() starts")
    return _rank_store


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 180.0,
    collective_timeout_s: float = 60.0,
    threads_per_rank: int = 1,
    env: Mapping[str, str] | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Spawn ``world_size`` ranks running ``fn``; return their results in rank order.

    ``fn`` must be importable (defined at module level). ``collective_timeout_s``
    is the process group's timeout, so a collective that a failed peer never
    joins errors out instead of waiting for torch's default 30 minutes. With
    ``backend="nccl"``, rank ``r`` uses CUDA device ``r`` (modulo the count).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    context = _process_context()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    results: queue.Queue = context.Queue()
    child_env = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"), **(env or {})}
    crash_dir = tempfile.TemporaryDirectory(prefix="commsched-ranks-")
    crash_logs = [os.path.join(crash_dir.name, f"rank{rank}.crash") for rank in range(world_size)]
    processes = [
        context.Process(
            target=_rank_main,
            args=(fn, rank, world_size, store.port, args, results, collective_timeout_s,
                  threads_per_rank, child_env, backend, crash_logs[rank]),
            name=f"commsched-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    try:
        outcomes = _collect(processes, results, timeout_s)
        _await_clean_exits(processes, outcomes)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
        del store
        _add_crash_stacks(processes, outcomes, crash_logs)
        crash_dir.cleanup()

    failures = {rank: text for rank, (ok, text) in outcomes.items() if not ok}
    if failures:
        report = "\n".join(f"----- rank {rank} -----\n{text}" for rank, text in sorted(failures.items()))
        raise RanksFailed(f"{len(failures)} of {world_size} ranks failed:\n{report}")
    return [outcomes[rank][1] for rank in range(world_size)]


PRELOADED_MODULES = ("torch", "torch.distributed", "torch._dynamo", "commsched")
"""What every rank imports before its process group exists (see [Note: the world group outlives
destroy_process_group]), imported once by the fork server rather than by each rank."""


def _process_context():
    """Ranks forked from a fork server that has imported torch once (a rank starts in a fraction
    of a second instead of the 2-3 s an import of torch costs each spawned one); spawned where
    there is no fork server. Either way a rank starts from a fresh interpreter's state: the fork
    server only imports, it never runs torch or makes a thread of its own."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOADED_MODULES))
    return context


def _collect(processes: list, results: queue.Queue, timeout_s: float) -> dict[int, tuple[bool, Any]]:
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(outcomes) < len(processes):
        now = time.monotonic()
        if now >= deadline:
            break
        try:
            rank, ok, payload = results.get(timeout=min(0.5, deadline - now))
            outcomes[rank] = (ok, payload)
            if not ok:
                deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
            continue
        except queue.Empty:
            pass
        for rank, process in enumerate(processes):
            if rank not in outcomes and not process.is_alive() and process.exitcode is not None:
                # Give its last message a moment to arrive before declaring it dead.
                try:
                    rank_, ok, payload = results.get(timeout=1.0)
                    outcomes[rank_] = (ok, payload)
                except queue.Empty:
                    outcomes[rank] = (False, f"process exited with code {process.exitcode} without reporting")
                    deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
                break
    for rank in range(len(processes)):
        if rank not in outcomes:
            outcomes[rank] = (False, f"did not finish within the time limit ({timeout_s:g} s or "
                                     f"{GRACE_AFTER_FAILURE_S:g} s after another rank failed); killed")
    return outcomes


def _await_clean_exits(processes: list, outcomes: dict[int, tuple[bool, Any]]) -> None:
    """A rank that reported success must also exit cleanly.

    An abort while the interpreter shuts down (a communication thread still
    running Python, a C++ thread destroyed while joinable) happens after the
    report; without this check it would go unnoticed.
    """
    deadline = time.monotonic() + EXIT_GRACE_S
    for rank, process in enumerate(processes):
        if not outcomes[rank][0]:
            continue
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.exitcode is None:
            outcomes[rank] = (False, f"reported success but did not exit within {EXIT_GRACE_S:g} s")
        elif process.exitcode == THREADS_LEFT_AT_EXIT:
            outcomes[rank] = (False, "reported success, then left threads running at exit")
        elif process.exitcode != 0:
            outcomes[rank] = (False, f"reported success, then exited with code {process.exitcode} "
                                     "(it crashed while shutting down)")


THREADS_LEFT_AT_EXIT = 70
"""The exit code of a rank that left threads running after its exit handlers (see [Note: ranks end as
a script ends])."""


CRASH_STACKS_CHARS = 6000
"""How much of a crashed rank's thread stacks its report quotes (the end, where the crash is)."""


def _add_crash_stacks(processes: list, outcomes: dict[int, tuple[bool, Any]], crash_logs: list[str]) -> None:
    """Quote, in the report of a rank killed by a signal, the Python stacks of its threads at that moment;
    in that of a rank that left threads running at exit, their names.

    A rank that aborts (a C++ ``terminate``, a fatal signal), often as it ends
    after it reported success, leaves nothing else to go on: its stderr is the
    parent's, interleaved and often not kept.
    """
    for rank, process in enumerate(processes):
        code = process.exitcode
        if rank not in outcomes or outcomes[rank][0] or code is None or (code >= 0 and code != THREADS_LEFT_AT_EXIT):
            continue
        try:
            with open(crash_logs[rank], errors="replace") as log:
                stacks = log.read().strip()
        except OSError:
            continue
        if stacks:
            heading = "" if code == THREADS_LEFT_AT_EXIT else "its threads when it crashed (most recent call first):\n"
            outcomes[rank] = (False, f"{outcomes[rank][1]}\n{heading}{stacks[-CRASH_STACKS_CHARS:]}")


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple,
    results: queue.Queue,
    collective_timeout_s: float,
    threads_per_rank: int,
    env: Mapping[str, str],
    backend: str,
    crash_log: str,
) -> None:
    global _rank_store
    # Kept open for the life of the process: faulthandler writes to it from the signal handler.
    faulthandler.enable(file=open(crash_log, "w"), all_threads=True)  # noqa: SIM115
    os.environ.update(env)
    torch.set_num_threads(threads_per_rank)
    # [Note: the world group outlives destroy_process_group] torch imports torch._dynamo at an
    # optimizer's first step. Imported while a process group exists, it keeps references to the
    # world group where the garbage collector cannot see them, so destroy_process_group() no
    # longer frees it: the group, and gloo's threads, live on until the interpreter finalizes,
    # where freeing it may abort a rank that reported success ("terminate called without an
    # active exception"). Imported before the group exists, it holds none.
    importlib.import_module("torch._dynamo")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=collective_timeout_s))
        _rank_store = store
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _rank_store = None
    results.close()
    results.join_thread()  # the report is on its way: what follows may end the process
    _end_as_a_script_ends(crash_log)


def _end_as_a_script_ends(crash_log: str) -> None:
    """[Note: ranks end as a script ends] A rank forked from the fork server ends with
    ``os._exit``: no exit handler runs, and no thread is left to the interpreter's
    finalization, which is where a thread still running aborts a training script after a
    clean run. So the rank runs the exit handlers here (commsched's, for models never
    released), as a script's end would, and then fails if any thread still runs: it would
    have met the finalization. Threads that Python did not start are not counted: autograd's
    CUDA device threads, for one, show as ``threading._DummyThread`` once a hook run there asks
    for the current thread (a log record does), and they wait in C++ for the next backward,
    not in the interpreter. Nor are the idle workers of a ``concurrent.futures`` thread pool
    (torch's own prefetch of its cache key keeps one): a script's end shuts those pools down
    before finalization (``threading._register_atexit``), so the rank does that too."""
    atexit._run_exitfuncs()
    for shut_down_pools in reversed(getattr(threading, "_threading_atexits", [])):
        shut_down_pools()
    running = [thread.name for thread in threading.enumerate()
               if thread is not threading.main_thread() and thread.is_alive()
               and not isinstance(thread, threading._DummyThread)]
    if running:
        with open(crash_log, "a") as log:
            log.write(f"threads still running after the exit handlers: {', '.join(running)}. At a script's end "
                      "the interpreter's finalization ends them as they next take the GIL, which aborts the "
                      "process where one is inside C++ code (a store or collective call)\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(THREADS_LEFT_AT_EXIT)
