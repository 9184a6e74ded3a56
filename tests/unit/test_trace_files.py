"""Trace files are written through a fresh temporary file and a rename: a link planted at the
temporary or the final name is never written through, and a failed write mid-run is only logged."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

from commsched.engine.completion import CallbackTracker
from commsched.engine.trace import Tracer


def _tracer(directory: Path) -> Tracer:
    model = torch.nn.Linear(2, 2)
    return Tracer(directory, 0, model, list(model.parameters()), CallbackTracker())


def test_links_planted_at_the_temporary_or_final_name_are_not_written_through(tmp_path: Path):
    victim = tmp_path / "elsewhere"
    victim.write_text("untouched")
    directory = tmp_path / "trace"
    directory.mkdir()
    planted = ["rank0.json", f"rank0.json.{os.getpid()}.tmp"]  # the final name; the temporary name writers often use
    for name in planted:
        (directory / name).symlink_to(victim)
    tracer = _tracer(directory)
    tracer.note("plan", summary="one partition")

    path = tracer.write()

    assert victim.read_text() == "untouched"
    assert not path.is_symlink()
    assert [e["name"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "i"] == ["plan"]
    # Only the planted temporary link is left beside the trace: no temporary file of the write's own.
    assert sorted(os.listdir(directory)) == sorted(planted)


def test_a_write_that_fails_mid_run_is_logged_and_training_goes_on(tmp_path: Path, caplog, monkeypatch):
    # Configuring logging elsewhere in the session (import-linter does) may have disabled the logger.
    monkeypatch.setattr(logging.getLogger("commsched"), "disabled", False)
    directory = tmp_path / "trace"
    tracer = _tracer(directory)
    shutil.rmtree(directory)  # gone mid-run, as a full or unmounted disk would fail the write
    tracer.note("plan")
    with caplog.at_level(logging.WARNING, logger="commsched"):
        tracer.iteration_started(0)  # a rewrite: it fails
        tracer.iteration_started(20)  # and again: logged once
    warnings = [r for r in caplog.records if "could not write the trace" in r.getMessage()]
    assert len(warnings) == 1 and str(directory / "rank0.json") in warnings[0].getMessage()
    directory.mkdir()
    tracer.closed()  # the last write succeeds and holds every event
    assert [e["name"] for e in json.loads((directory / "rank0.json").read_text())["traceEvents"]
            if e["ph"] == "i"] == ["plan"]
