"""The timeline trace: files load, spans nest, every partition appears; the report reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import commsched
from commsched.bench.trace_report import report
from commsched.engine.lifecycle import WARMUP_ITERATIONS
from commsched.testing.models import ParityNet
from commsched.testing.shared_ranks import in_shared_ranks

pytestmark = pytest.mark.distributed
ITERATIONS = WARMUP_ITERATIONS + 3


def train_traced(rank: int, world_size: int, directory: str) -> int:
    torch.manual_seed(0)
    model = ParityNet()
    strategy = commsched.Strategy(trace_dir=directory, partition_mb=256 / 2**20, credit_mb=512 / 2**20, adaptive=False,
                                  bucket_cap_mb=0.004, first_bucket_mb=0.001)
    model, optimizer = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), strategy)
    for _ in range(ITERATIONS):
        F.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 4)).backward()
        optimizer.step()
        optimizer.zero_grad()
    model(torch.randn(4, 8))  # closes the last iteration span
    partitions = commsched.status(model).partitions
    commsched.release(model)  # writes the trace
    return partitions


@in_shared_ranks(train_traced, 2, timeout_s=180, tmp_dir=True)
def test_trace_files_spans_and_report(shared_ranks):
    tmp_path = shared_ranks.path
    partitions = shared_ranks.result()[0]
    for rank in range(2):
        events = [e for e in json.loads((tmp_path / f"rank{rank}.json").read_text())["traceEvents"] if e["ph"] == "X"]
        # every partition is queued and on the wire in every iteration
        for row in ("queue", "wire"):
            per_iteration = {}
            for e in events:
                if e["tid"] == row:
                    per_iteration.setdefault(e["args"]["iteration"], []).append(e["name"])
            assert sorted(per_iteration) == list(range(ITERATIONS)), row
            assert all(len(set(names)) == partitions for names in per_iteration.values()), row
        # forward spans nest: each child's forward lies inside its parent's
        forward = {e["name"].removeprefix("forward "): e for e in events if e["name"].startswith("forward ")}
        child, parent = forward["blocks.0"], forward["blocks"]
        assert parent["ts"] <= child["ts"] and child["ts"] + child["dur"] <= parent["ts"] + parent["dur"]
        assert any(e["name"] == "backward head" for e in events)
        assert any(e["name"].startswith("update b") for e in events)
        iterations = [e for e in events if e["name"] == "iteration"]
        assert len(iterations) == ITERATIONS
        # the wire never runs before the queue hands the partition over, for every partition
        queued = {(e["args"]["iteration"], e["name"]): e for e in events if e["tid"] == "queue"}
        wire = [e for e in events if e["tid"] == "wire"]
        assert partitions > 0 and len(wire) == len(queued) == ITERATIONS * partitions, (len(wire), len(queued))
        for e in wire:
            q = queued[(e["args"]["iteration"], e["name"])]
            assert e["ts"] >= q["ts"] + q["dur"] - 1.0, (e, q)
    text = report(tmp_path, png=tmp_path / "gantt.png")
    assert "overlap" in text and f"median over {2 * ITERATIONS} rank-iterations" in text
    assert "the slowest rank's backward pass took" in text
    assert (tmp_path / "gantt.png").stat().st_size > 10_000


def trace_dir_unusable_on_rank_1(rank: int, world_size: int, directory: str) -> tuple[str, str]:
    """Rank 1's trace_dir lies under a file; each rank returns the error its prepare() raised."""
    if rank == 1:
        (Path(directory) / "a-file").write_text("")
    trace_dir = str(Path(directory) / ("a-file/trace" if rank == 1 else "trace"))
    torch.manual_seed(0)
    model = ParityNet()
    try:
        commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01),
                          commsched.Strategy(trace_dir=trace_dir, timeout_s=20))
    except (OSError, ValueError) as error:
        return type(error).__name__, str(error)
    raise AssertionError("prepare() went on although rank 1 cannot write its trace")


@in_shared_ranks(trace_dir_unusable_on_rank_1, 2, timeout_s=60, tmp_dir=True)
def test_a_trace_dir_one_rank_cannot_write_stops_every_rank_at_prepare(shared_ranks):
    unusable = str(shared_ranks.path / "a-file" / "trace")
    # Both are told at once which rank failed, which directory and why: rank 0 does not wait for
    # rank 1 in vain.
    for kind, message in shared_ranks.result():
        assert kind == "ValueError" and "failed on rank(s) [1]" in message, message
        assert f"trace_dir={unusable!r}" in message and "Not a directory" in message, message


def test_report_without_traces_says_what_to_do(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"Strategy\(trace_dir="):
        report(tmp_path)


def profiled_phases(rank: int, world_size: int) -> list[str]:
    """``torch.profiler`` over warm-up and two overlapped iterations: the phase labels it recorded."""
    torch.manual_seed(0)
    model = ParityNet()
    model, optimizer = commsched.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01),
                                         commsched.Strategy(bucket_cap_mb=0.004, first_bucket_mb=0.001))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in range(WARMUP_ITERATIONS + 2):
            F.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 4)).backward()
            optimizer.step()
            optimizer.zero_grad()
        model(torch.randn(4, 8))  # the last step's buckets, updated at their gates
    commsched.release(model)
    return sorted({event.key for event in profile.key_averages() if event.key.startswith("commsched::")})


@in_shared_ranks(profiled_phases, 2, timeout_s=120)
def test_a_profile_shows_commscheds_phases(shared_ranks):
    """What a user sees in a profile: the gates, the waits for reductions, the updates, the step and
    the end of warm-up, each labelled (FSDP2 labels its phases alike)."""
    for labels in shared_ranks.result():
        assert labels == ["commsched::gate", "commsched::reduce_wait", "commsched::step", "commsched::update",
                          "commsched::warmup"], labels
