"""What a survivor's heartbeat watch says, on a real store: who lags behind, a store whose process
ended, and marks an earlier job left in the same store."""

from __future__ import annotations

import gc

import pytest
import torch.distributed as dist

from commsched.comm import heartbeat
from commsched.comm.heartbeat import Heartbeat


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_a_peer_that_has_not_begun_this_ranks_iteration_is_named_as_the_one_that_did_not_answer(store):
    waiting, slow = (Heartbeat("127.0.0.1", store.port, rank, [0, 1]) for rank in (0, 1))
    try:
        waiting.at_iteration(6)
        slow.at_iteration(5)
        verdict = waiting.lost_peers()
    finally:
        waiting.stop()
        slow.stop()
    assert "Rank 1 did not answer in time" in verdict and "rank 1 at iteration 5" in verdict, verdict
    assert "network" not in verdict, verdict


def test_a_store_whose_process_ended_is_not_taken_for_this_ranks_network():
    """The rank that hosted the store gave up waiting for this (slow) rank and ended."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    beat = Heartbeat("127.0.0.1", store.port, 1, [0, 1])
    try:
        del store  # the server: its process ended
        verdict = beat.lost_peers()
    finally:
        beat.stop()
    assert "refuses connections" in verdict and "has ended" in verdict, verdict
    assert "network" not in verdict, verdict


def test_a_failure_marked_by_an_earlier_job_in_the_same_store_is_not_believed(store, monkeypatch):
    monkeypatch.setattr(heartbeat, "SILENCE_S", 0.6)
    earlier = [Heartbeat("127.0.0.1", store.port, rank, [0, 1]) for rank in (0, 1)]
    earlier[0].lost_peers()  # rank 0 of the earlier job had a communication error of its own
    for beat in earlier:
        beat.stop()
    # This job's rank 0 dies before it beats: its silence is the cause, whatever the earlier job left.
    survivor = Heartbeat("127.0.0.1", store.port, 1, [0, 1])
    try:
        verdict = survivor.lost_peers()
    finally:
        survivor.stop()
    assert "Rank 0 stopped responding" in verdict and "ended after" not in verdict, verdict


def test_a_heartbeat_reuses_the_store_clients_a_stopped_one_gave_back(store):
    """[Note: store clients are reused]: a prepare() after another opens no new connection to the
    job's store; clients of another job's store are never taken."""
    job = dist.PrefixStore("job", dist.TCPStore("127.0.0.1", store.port, is_master=False))
    first = Heartbeat("127.0.0.1", store.port, 0, [0, 1], store=job)
    clients = {id(first.store_client), id(first.cloning_client)}
    first.stop()
    second = Heartbeat("127.0.0.1", store.port, 0, [0, 1], store=job)
    try:
        assert {id(second.store_client), id(second.cloning_client)} == clients
    finally:
        second.stop()
    other_job = dist.PrefixStore("other", dist.TCPStore("127.0.0.1", store.port, is_master=False))
    third = Heartbeat("127.0.0.1", store.port, 0, [0, 1], store=other_job)
    try:
        assert not {id(third.store_client), id(third.cloning_client)} & clients
        third.store_client.set("written", "under its own prefix")
        assert other_job.check(["written"]) and not job.check(["written"])
    finally:
        third.stop()


def _beats_within(thread, seconds: float) -> bool:
    thread.join(timeout=seconds)
    return thread.is_alive()


def test_a_heartbeat_dropped_without_stop_ends_its_thread(store):
    """A model never released but collected (a prepare() that failed half-way, a dropped copy) takes its
    beat along: none runs on into the interpreter's finalization ([Note: no beat at finalization])."""
    beat = Heartbeat("127.0.0.1", store.port, 0, [0, 1])
    thread = beat.thread
    del beat
    gc.collect()
    assert not _beats_within(thread, 4 * heartbeat.BEAT_PERIOD_S)


def test_at_exit_the_beats_nobody_stopped_are_ended_and_waited_for(store):
    beats = [Heartbeat("127.0.0.1", store.port, rank, [0, 1]) for rank in (0, 1)]
    beats[0].stop()
    heartbeat._RUNNING.end_all()  # what runs at exit, after every model's own exit handler
    assert not beats[1].thread.is_alive()
    beats[1].stop()  # idempotent after it
