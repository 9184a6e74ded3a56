"""Ending a run: groups only commsched holds are freed when the model is released.

``commsched.release(model)`` and the exit handler of a model never released
share `GradientReducer.shut_down`. Freed later, while the interpreter
finalizes, a gloo group can abort the process after a clean run (see [Note:
process groups at exit] in commsched/engine/reducer.py).
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import commsched
from commsched.testing import run_ranks
from commsched.testing.internals import reducer_of
from commsched.testing.models import ParityNet

pytestmark = pytest.mark.distributed


GLOO_THREADS_END_WITHIN_S = 5.0


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def groups_freed_at_exit(rank: int, world_size: int) -> tuple[int, int, int]:
    with_world_group = thread_count()
    torch.manual_seed(0)
    model = ParityNet()
    model, optimizer = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(2):
        F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 4)).backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.synchronize()
    dist.destroy_process_group()
    after_destroy = thread_count()
    commsched.release(model)  # shuts down as the exit handler does, after waiting for what is in flight
    assert commsched.status(model).lifecycle is commsched.Lifecycle.RELEASED
    return with_world_group, after_destroy, thread_count()


def groups_of_an_adopting_model_freed_at_release(rank: int, world_size: int) -> tuple[int, int]:
    """A model that would adopt its optimizer at the first step (`commsched.DistributedDataParallel`)
    but never took one (evaluated only, say), its world group destroyed by the script: release frees
    that group as well."""
    with_world_group = thread_count()
    torch.manual_seed(0)
    model = commsched.DistributedDataParallel(ParityNet())
    with torch.no_grad():
        model(torch.randn(4, 8))
    dist.destroy_process_group()
    commsched.release(model)
    del model  # the wrapper holds its process_group, as torch DDP's does
    return with_world_group, thread_count()


def threads_after_parameter_server_jobs(rank: int, world_size: int) -> list[int]:
    """Two parameter-server jobs in turn (workers release their models, the server serves each):
    this rank's thread count before the first and after each, once the destroyed groups' threads
    ended (gloo's loops take a moment after ``destroy_process_group`` returns). A job's groups are
    destroyed when the rank is done with them ([Note: groups a model made for itself])."""
    strategy = commsched.Strategy(backend=commsched.ParameterServer(num_servers=1))
    counts = [thread_count()]
    for _ in range(2):
        torch.manual_seed(0)
        model = ParityNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if rank == world_size - 1:
            commsched.serve(model, optimizer, strategy)
        else:
            model, optimizer = commsched.prepare(model, optimizer, strategy)
            for _ in range(2):
                F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 4)).backward()
                optimizer.step()
                optimizer.zero_grad()
            commsched.release(model)
        deadline = time.monotonic() + GLOO_THREADS_END_WITHIN_S
        while thread_count() > counts[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        counts.append(thread_count())
    return counts


def dropped_models_are_collected(rank: int, world_size: int) -> list[bool]:
    """Models trained past warm-up (forward overlap on, and off), then dropped with their
    optimizers, never released: after a collection each reducer (buckets, plan, transport) is
    gone ([Note: tensor hooks hold their target weakly] in commsched/engine/hooks.py). The
    ``synchronize()`` first lets the last step's operations finish; until they have, their
    callbacks hold the reducer, and the model goes at a later collection."""
    collected = []
    for strategy in (commsched.Strategy(), commsched.Strategy(overlap_forward=False)):
        torch.manual_seed(0)
        model = ParityNet()
        model, optimizer = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy)
        for _ in range(6):
            F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 4)).backward()
            optimizer.step()
            optimizer.zero_grad()
        optimizer.synchronize()
        reducer = weakref.ref(reducer_of(model))
        del model, optimizer
        gc.collect()
        collected.append(reducer() is None)
    return collected


def operations_left_in_cyclic_garbage(rank: int, world_size: int) -> int:
    """Objects that only the garbage collector would free, holding a torch.distributed operation."""
    gc.collect()
    gc.disable()  # what a run leaves for the collector stays until the count below
    try:
        torch.manual_seed(0)
        model = ParityNet()
        model, optimizer = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in range(6):  # warm-up, then passes retired one after the other
            F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 4)).backward()
            optimizer.step()
            optimizer.zero_grad()
        commsched.release(model)
        del model, optimizer
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        holders = [o for o in gc.garbage if any(isinstance(r, dist.Work) for r in gc.get_referents(o))]
        return len(holders)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_a_model_dropped_without_release_is_freed():
    """Its parameters' gradient hooks held the reducer from inside their C++ side, where the
    garbage collector cannot see: a cycle never broken, so the model lived to the process's end."""
    assert run_ranks(dropped_models_are_collected, 2, timeout_s=120) == [[True, True], [True, True]]


def test_no_operation_is_left_for_the_interpreters_finalization():
    """Operations freed only while the interpreter finalizes may abort the process after a clean run
    ([Note: process groups at exit] in commsched/engine/reducer.py): each pass lets go of them when retired."""
    assert run_ranks(operations_left_in_cyclic_garbage, 2, timeout_s=120) == [0, 0]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task (Linux)")
def test_destroyed_groups_are_freed_at_exit():
    counts = run_ranks(groups_freed_at_exit, 2, timeout_s=120)
    assert len(counts) == 2
    for rank, (with_world_group, after_destroy, at_exit) in enumerate(counts):
        # After destroy_process_group() the reducer still holds its buffer group,
        # whose gloo threads run on ...
        assert after_destroy > with_world_group, (rank, with_world_group, after_destroy)
        # ... until release (or the exit handler) lets go and the group's destructor joins them.
        assert at_exit <= with_world_group, (rank, with_world_group, after_destroy, at_exit)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task (Linux)")
def test_a_parameter_server_job_leaves_no_group_running():
    """Each job made three groups (workers, buffers, transport) that torch kept, with their
    threads, to the end of the process: a worker's threads grew by 9 per job. Then the last
    pushes' operations held the transport group's gloo device, and its loop thread, alive."""
    for rank, (before, after_first, after_second) in enumerate(
            run_ranks(threads_after_parameter_server_jobs, 3, timeout_s=120)):
        assert after_first <= before and after_second <= before, (rank, before, after_first, after_second)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task (Linux)")
def test_the_groups_of_a_model_that_adopts_its_optimizer_are_freed_at_release():
    for rank, (with_world_group, at_release) in enumerate(
            run_ranks(groups_of_an_adopting_model_freed_at_release, 2, timeout_s=120)):
        # The world group's own threads are gone too: nothing commsched made still holds it.
        assert at_release < with_world_group, (rank, with_world_group, at_release)


# --------------------------------------------------------------- after a failure
# Each rank is a process of its own started the way torchrun starts one (env://
# rendezvous, the process group's default 30-minute timeout), so that what is
# measured is the exit of a real training script: the survivor lets the
# CommunicationTimeout end it, and the parent times that exit.

SCRIPT = """
import faulthandler, os, sys, time
import torch, torch.distributed as dist, torch.nn.functional as F
import commsched

victim, signum, at = (int(arg) for arg in sys.argv[1:4])
backend, ending = sys.argv[4:6]
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
if backend == "ps":
    strategy = commsched.Strategy(backend=commsched.ParameterServer(num_servers=1), timeout_s=3.0)
elif backend == "sharded":
    strategy = commsched.Strategy(backend=commsched.AllReduce(shard_optimizer=True), timeout_s=3.0)
elif backend == "two_step":  # every partition all-reduced in two all-to-alls
    strategy = commsched.Strategy(backend=commsched.AllReduce(all_to_all_mb=1024), timeout_s=3.0)
else:
    strategy = commsched.Strategy(timeout_s=3.0)
model, optimizer = commsched.prepare(model, optimizer, strategy)
generator = torch.Generator().manual_seed(rank)
try:
    for iteration in range(100000):
        if iteration == at and rank == victim:
            if signum == 0:
                raise ValueError("the victim's own error")  # uncaught: it ends the script
            if signum < 0:  # caught, and the script exits with a status of its own
                try:
                    raise ValueError("the victim's own error")
                except ValueError:
                    sys.exit(1)
            if backend != "sharded":
                os.kill(os.getpid(), signum)
        F.mse_loss(model(torch.randn(8, 32, generator=generator)), torch.zeros(8, 4)).backward()
        if iteration == at and rank == victim and backend == "sharded":
            optimizer.synchronize()  # its reductions are done: the others wait in the all-gathers
            os.kill(os.getpid(), signum)
        optimizer.step()
        optimizer.zero_grad()
except commsched.CommunicationTimeout as error:
    print("ERROR", repr(time.time()), str(error).replace("\\n", " "), flush=True)
    faulthandler.dump_traceback_later(float(sys.argv[6]), file=sys.stdout)  # an exit slower than that: where
    if ending == "destroy":  # what the README tells a script that catches the error
        dist.destroy_process_group()
        sys.exit(3)
    raise
print("FINISHED", flush=True)
"""

EXIT_WITHIN_S = 30.0
"""Ending on its own, instead of after the group's timeout (30 minutes): seconds here; as in
test_cluster_faults.py, room for a loaded 2-core machine. A rank slower than `SLOW_EXIT_S` prints
where its threads are."""
SLOW_EXIT_S = 5.0


def _read_lines(process: subprocess.Popen, lines: list[str]) -> None:
    for line in process.stdout:
        lines.append(line)


def survivors_after_a_failure(victim: int, signum: int, at: int, backend: str, ending: str, world_size: int = 3,
                              logs: list[str] | None = None):
    """Run the job; ``victim`` signals itself (signal 0: raises an exception; -1: raises one, catches it and
    calls ``sys.exit(1)``) as iteration ``at`` starts (with ``backend="sharded"``, once that iteration's
    reductions are done). Per survivor: (message, seconds from its error to its exit, or None if it had not exited
    ``EXIT_WITHIN_S`` + 10 s after it, return code, log). ``logs``: filled with every rank's log."""
    # The job's store lives here, as torchrun's agent hosts it, so that it outlives every rank.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    processes, outputs = [], []
    for rank in range(world_size):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": str(rank),
               "WORLD_SIZE": str(world_size), "GLOO_SOCKET_IFNAME": "lo", "TORCHELASTIC_USE_AGENT_STORE": "True"}
        process = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(victim), str(int(signum)), str(at), backend, ending,
             str(SLOW_EXIT_S)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        threading.Thread(target=_read_lines, args=(process, lines), daemon=True).start()
        processes.append(process)
        outputs.append(lines)
    survivors = [rank for rank in range(world_size) if rank != victim
                 and not (backend == "ps" and rank == world_size - 1)]  # a server serves, never raises
    exited_at: dict[int, float] = {}
    results = {}
    try:
        deadline = time.time() + 180
        while time.time() < deadline and len(exited_at) < len(survivors):
            time.sleep(0.02)
            for rank in survivors:
                if rank not in exited_at and processes[rank].poll() is not None:
                    exited_at[rank] = time.time()
            errors = [_error_of(outputs[rank]) for rank in survivors]
            if all(errors):  # every survivor has its error: each gets EXIT_WITHIN_S, and 10 s to spare
                deadline = min(deadline, max(at for at, _ in errors) + EXIT_WITHIN_S + 10)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()  # also a stopped victim
            process.wait(timeout=30)
    if logs is not None:
        logs[:] = ["".join(lines) for lines in outputs]
    for rank in survivors:
        log = "".join(outputs[rank])
        error = _error_of(outputs[rank])
        assert error is not None, f"rank {rank} got no CommunicationTimeout:\n{log[-3000:]}"
        at, message = error
        exit_s = exited_at[rank] - at if rank in exited_at else None
        results[rank] = (message, exit_s, processes[rank].returncode, log)
    return results


def _error_of(lines: list[str]) -> tuple[float, str] | None:
    for line in list(lines):
        if line.startswith("ERROR "):
            _, at, message = line.split(" ", 2)
            return float(at), message
    return None


def _check_prompt_exits(results, expected_code: int, named: str) -> None:
    assert results, "no survivor to check"
    for rank, (message, exit_s, code, log) in results.items():
        assert exit_s is not None and exit_s < EXIT_WITHIN_S, (
            f"rank {rank} got its error, then took {exit_s if exit_s is None else round(exit_s, 1)} s "
            f"to exit (None: had not exited after {EXIT_WITHIN_S + 10:g} s):\n{log[-3000:]}")
        # Known: rarely, a completion callback of an abandoned reduction fires while the interpreter
        # finalizes (a peer's exit ends it) and the process dies by a signal, promptly all the same.
        assert code in (expected_code, -signal.SIGSEGV, -signal.SIGABRT), (
            f"rank {rank} exited with {code}, expected {expected_code}:\n{log[-3000:]}")
        assert named in message, (rank, message)


KILL_AT = 6
"""After the plan's agreement at iteration 3."""


def test_survivors_of_a_stopped_peer_exit_promptly():
    """Rank 1 is stopped (SIGSTOP): its sockets stay open, so ranks 0 and 2 wait for the timeout,
    name it, and end: the exception ends the script (exit code 1)."""
    results = survivors_after_a_failure(1, signal.SIGSTOP, KILL_AT, "allreduce", "raise")
    _check_prompt_exits(results, 1, "Rank 1 stopped responding")


def test_survivors_of_a_killed_peer_exit_promptly():
    """Rank 1 is killed: one neighbour sees its socket close, the other waits for the timeout; both
    name it; the script catches the error, destroys the process group and exits."""
    results = survivors_after_a_failure(1, signal.SIGKILL, KILL_AT, "allreduce", "destroy")
    _check_prompt_exits(results, 3, "Rank 1 stopped responding")


def test_survivors_of_a_peer_killed_amid_two_step_all_reduces_exit_promptly():
    """As above, with every partition all-reduced in two steps: a second step issued from a
    completion, on its own group, must not keep a survivor from its error or its exit."""
    results = survivors_after_a_failure(1, signal.SIGKILL, KILL_AT, "two_step", "destroy")
    _check_prompt_exits(results, 3, "Rank 1 stopped responding")


def test_survivors_of_a_peer_killed_amid_sharded_all_gathers_name_it():
    """Sharded optimizer state: rank 1 dies once its reductions are done, so the survivors wait in
    the all-gathers of updated parameters (resharding's take the same path), which named no rank
    ("Another rank probably died")."""
    results = survivors_after_a_failure(1, signal.SIGKILL, KILL_AT, "sharded", "destroy")
    _check_prompt_exits(results, 3, "Rank 1 stopped responding")


def test_worker_of_a_stopped_parameter_server_job_exits_promptly():
    """Parameter servers: worker 1 stops as iteration 3 starts, so worker 0 waits alone in the
    workers' agreement on the plan, times out, and ends."""
    results = survivors_after_a_failure(1, signal.SIGSTOP, 3, "ps", "raise")
    _check_prompt_exits(results, 1, "plan")


def test_a_crashed_parameter_server_worker_is_reported_as_a_crash():
    """Worker 1 raises an exception of its own: the server stops naming the crash (not a worker that
    finished early), and worker 0's error quotes it; worker 0, left with a dead server, exits promptly
    with nothing raised by its shutdown at exit."""
    logs: list[str] = []
    results = survivors_after_a_failure(1, 0, KILL_AT, "ps", "raise", logs=logs)
    _check_prompt_exits(results, 1, "worker rank 1 failed with an exception after iteration 5: ValueError: "
                                     "the victim's own error")
    assert "Exception ignored" not in results[0][3], results[0][3][-3000:]
    server = logs[2]
    assert "ParameterServerError: worker rank 1 failed with an exception" in server, server[-3000:]
    assert "finished after" not in server, server[-3000:]


def test_a_parameter_server_worker_that_exits_after_a_caught_error_is_not_called_finished():
    """Worker 1 catches an error of its own and calls ``sys.exit(1)``: no process can read its own
    exit status, so the server cannot tell this from running out of batches; its error, quoted by
    worker 0, says both and the cure of each, in the current spelling, and calls it no finish."""
    logs: list[str] = []
    results = survivors_after_a_failure(1, -1, KILL_AT, "ps", "raise", logs=logs)
    _check_prompt_exits(results, 1, "worker rank 1 ended after")
    for text in (results[0][0], logs[2]):
        assert "stopped on an error it caught" in text and "rank 1's log tells which" in text, text[-3000:]
        assert "finished after" not in text and "ps_mode" not in text, text[-3000:]
        assert "ParameterServer(mode='sync')" in text, text[-3000:]


# --------------------------------------------------------------- a complete run's exit
IN_FLIGHT_AT_EXIT = """
import atexit, os, sys
import torch, torch.distributed as dist, torch.nn.functional as F

ending = sys.argv[1]
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
# Registered before commsched's own exit handler, so it runs after it.
atexit.register(lambda: store.set(f"rank {rank} past commsched's exit", "1"))
import commsched

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))
strategy = commsched.Strategy(credit_mb=None)  # no credit: nothing waits for a completion's callback
model, optimizer = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy)

def train_step():
    F.mse_loss(model(torch.randn(8, 32)), torch.zeros(8, 4)).backward()
    optimizer.step()
    optimizer.zero_grad()

for _ in range(6):  # warm-up is over: step() returns before the reductions
    train_step()
if rank == 1:
    train_step()  # its reductions can finish only once rank 0 has issued its own
    if ending == "destroy":
        dist.destroy_process_group()
else:
    try:
        store.wait(["rank 1 past commsched's exit"], datetime.timedelta(seconds=3))
        print("EARLY rank 1 was past commsched's exit handler with its reductions in flight", flush=True)
    except RuntimeError:  # the wait timed out: rank 1 is still in its exit handler, waiting for this rank
        pass
    train_step()
    optimizer.synchronize()
    if ending == "destroy":
        dist.destroy_process_group()
print("FINISHED", flush=True)
""".replace("import atexit, os, sys", "import atexit, datetime, os, sys")


def run_script(script: str, world_size: int, *args: str, timeout_s: float = 120) -> list[tuple[int | None, str]]:
    """``script`` on ``world_size`` processes started as torchrun starts them (env://, the job's store
    here); per rank, its exit code (None: killed after ``timeout_s``) and its output."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    processes = [
        subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                                         "RANK": str(rank), "WORLD_SIZE": str(world_size),
                                         "TORCHELASTIC_USE_AGENT_STORE": "True"})
        for rank in range(world_size)]
    results = []
    for process in processes:
        try:
            output, _ = process.communicate(timeout=timeout_s)
            results.append((process.returncode, output))
        except subprocess.TimeoutExpired:
            process.kill()
            results.append((None, process.communicate()[0]))
    return results


@pytest.mark.parametrize("ending", ["exit", "destroy"])
def test_a_complete_run_leaves_nothing_in_flight_for_the_interpreters_finalization(ending):
    """A script that ends right after ``step()`` (forward overlap on) with its reductions still in
    flight: commsched's exit handler waits for them, so nothing finishes while the interpreter
    finalizes, where a completion aborts the process ("terminate called without an active
    exception", one run in four of a 2-rank script; [Note: operations in flight at exit] in
    `commsched.engine.shutdown`). Rank 0 joins rank 1's last reductions only after giving rank 1
    3 s to get past commsched's exit handler, which it must not: it is waiting for them."""
    for rank, (code, output) in enumerate(run_script(IN_FLIGHT_AT_EXIT, 2, ending)):
        assert code == 0 and "FINISHED" in output, (rank, code, output[-3000:])
        assert "EARLY" not in output and "terminate called" not in output, (rank, output[-3000:])
