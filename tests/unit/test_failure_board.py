"""Parameter-server failure notes, on a real store: each carries its writer and iteration, and only
notes of this job, under their writer's own keys, are believed."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from commsched.ps.roles import FailureBoard, FailureNote

PREFIX = "commsched/ps/1"
RANKS = [0, 1, 2]  # workers 0 and 1, server 2


def test_only_this_jobs_notes_under_their_writers_keys_are_believed_crash_first():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def job_store() -> dist.Store:  # as torch prefixes the default group's store
        client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=10))
        return dist.PrefixStore("default_pg", client)

    earlier = FailureBoard(PREFIX, 2, RANKS, job_store())  # an earlier job in the same store
    earlier.report_failure("worker rank 0 was lost by parameter server rank 2 during iteration 7", 7)

    reader = FailureBoard(PREFIX, 0, RANKS, job_store())
    assert reader.failure() is None
    # A note under worker 1's key that claims the server wrote it is not believed either.
    forged = FailureNote("failure", 2, 3, "worker rank 0 was lost", tick=10**9)
    master.set(f"default_pg/{PREFIX}/failure/1", forged.encode())
    master.append(f"default_pg/{PREFIX}/noted", "failure/1;")
    assert reader.failure() is None
    assert reader.wait_for_failure(0.2) is None

    server = FailureBoard(PREFIX, 2, RANKS, job_store())
    server.report_departure("worker rank 1 closed its connection to parameter server rank 2", 4)
    assert reader.failure() == ("worker rank 1 closed its connection to parameter server rank 2 "
                                "(noted by rank 2 at iteration 4)")
    server.report_failure("worker rank 1 was lost by parameter server rank 2 during iteration 5", 5)
    server.report_failure("a consequence, noted later", 5)  # the first failure a rank notes is the cause
    assert reader.failure() == ("worker rank 1 was lost by parameter server rank 2 during iteration 5 "
                                "(noted by rank 2 at iteration 5)")
    FailureBoard(PREFIX, 1, RANKS, job_store()).report_crash(
        "worker rank 1 failed with an exception during iteration 5: ValueError: bad\nbatch", 5)
    assert reader.wait_for_failure(0.2) == ("worker rank 1 failed with an exception during iteration 5: "
                                            "ValueError: bad batch (noted by rank 1 at iteration 5)")
    assert reader.note_of("crash", 1).iteration == 5
