"""``Trainer(strategy="commsched")`` against Lightning's own torch DDP strategy, on Lightning's demo models.

`lightning_script.py` runs under torchrun (2 gloo ranks) once with
``strategy="ddp"`` and once with ``strategy="commsched"``, both at once; the
tests compare what they wrote. The in-process tests check the refusals that
need no process group.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip(
    "lightning", reason="commsched.integrations.lightning needs lightning (pip install commsched[lightning])")

from lightning.pytorch import Trainer  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

import commsched  # noqa: E402
from commsched.integrations.lightning import CommschedStrategy, _settled_clipping  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "integrations" / "lightning_script.py"
STRATEGIES = ("ddp", "commsched")
TIMEOUT_S = 240
RANKS = (0, 1)
CHECKPOINTS = ("ckpt1/epoch=0-step=4.ckpt", "ckpt1/epoch=1-step=8.ckpt", "ckpt2/epoch=2-step=12.ckpt",
               "final.ckpt", "manual.ckpt")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both runs, side by side; a run that fails or hangs fails every test with its log's tail."""
    base = tmp_path_factory.mktemp("lightning")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launched: dict[str, tuple[subprocess.Popen, Path]] = {}
    for strategy in STRATEGIES:
        log = base / f"{strategy}.log"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                   str(SCRIPT), "--strategy", strategy, "--out", str(base / strategy)]
        with log.open("w") as output:
            process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        launched[strategy] = (process, log)
    deadline = time.monotonic() + TIMEOUT_S
    failures = []
    for strategy, (process, log) in launched.items():
        try:
            code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = f"killed after {TIMEOUT_S} s"
        if code != 0:
            lines = log.read_text(errors="replace").splitlines()
            raised = [line for line in lines if re.match(r"\[rank\d+\]: \w+(Error|Exception)\b", line)]
            tail = "\n".join(lines[-30:])
            failures.append(f"strategy={strategy!r}: exit {code}\n" + "\n".join(raised) + f"\n...\n{tail}")
    if failures:
        pytest.fail("\n\n".join(failures))
    return {strategy: base / strategy for strategy in STRATEGIES}


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.distributed
@pytest.mark.parametrize("rank", RANKS)
def test_every_loss_matches_ddp(runs: dict[str, Path], rank: int) -> None:
    trained = {"fit1", "fit2", "manual"}  # (torch DDP also trains the model commsched refuses)
    ddp = [r for r in _records(runs["ddp"] / f"losses_rank{rank}.jsonl") if r["phase"] in trained]
    ours = _records(runs["commsched"] / f"losses_rank{rank}.jsonl")
    phases = {r["phase"] for r in ddp}
    assert phases == trained, phases
    assert sum("val_loss" in r for r in ddp) == 4, "validation during both fits"
    assert len(ours) == len(ddp) == 38
    for mine, theirs in zip(ours, ddp, strict=True):
        assert mine.keys() == theirs.keys() and mine["step"] == theirs["step"], (mine, theirs)
        key = "val_loss" if "val_loss" in theirs else "loss"
        assert mine[key] == pytest.approx(theirs[key], rel=1e-5), (mine, theirs)


@pytest.mark.distributed
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_checkpoints_match_ddp(runs: dict[str, Path], name: str) -> None:
    """Weights, optimizer state (momentum), LR scheduler and loop state, saved during and after fit."""
    ddp = torch.load(runs["ddp"] / name, weights_only=False)
    ours = torch.load(runs["commsched"] / name, weights_only=False)
    assert ours["global_step"] == ddp["global_step"] and ours["epoch"] == ddp["epoch"]
    assert ours["state_dict"].keys() == ddp["state_dict"].keys() and ddp["state_dict"]
    for key, value in ddp["state_dict"].items():
        torch.testing.assert_close(ours["state_dict"][key], value, rtol=1e-4, atol=1e-7, msg=lambda m: f"{key}: {m}")
    (our_optimizer,), (ddp_optimizer,) = ours["optimizer_states"], ddp["optimizer_states"]
    assert our_optimizer["param_groups"] == ddp_optimizer["param_groups"]
    assert our_optimizer["state"].keys() == ddp_optimizer["state"].keys()
    for index, state in ddp_optimizer["state"].items():
        for field, value in state.items():
            torch.testing.assert_close(our_optimizer["state"][index][field], value, rtol=1e-4, atol=1e-7)
    assert ours["lr_schedulers"] == ddp["lr_schedulers"]
    assert ours["loops"] == ddp["loops"]


@pytest.mark.distributed
@pytest.mark.parametrize("rank", RANKS)
def test_test_and_validate_metrics_match_ddp(runs: dict[str, Path], rank: int) -> None:
    ddp = json.loads((runs["ddp"] / f"results_rank{rank}.json").read_text())
    ours = json.loads((runs["commsched"] / f"results_rank{rank}.json").read_text())
    assert set(ddp) == {"test", "validate"} and ddp["test"][0]["test_loss"] > 0
    for stage, results in ddp.items():
        assert [list(r) for r in ours[stage]] == [list(r) for r in results]
        for mine, theirs in zip(ours[stage], results, strict=True):
            assert mine == {key: pytest.approx(value, rel=1e-5) for key, value in theirs.items()}


@pytest.mark.distributed
@pytest.mark.parametrize("rank", RANKS)
def test_forward_overlap_was_on_in_every_fit(runs: dict[str, Path], rank: int) -> None:
    """With clipping, accumulation, bf16, schedulers, validation and checkpoints during fit, and in manual mode."""
    status = _records(runs["commsched"] / f"status_rank{rank}.jsonl")
    assert [s["phase"] for s in status] == ["fit1", "fit2", "manual"]
    for record in status:
        assert record["overlapping"] and record["overlap_off_reason"] is None, record
    # One synchronised backward pass per optimizer step: accumulated micro-batches ran under no_sync().
    # (Overlap starts at the fourth.)
    assert [s["iterations"] for s in status] == [8, 6, 6]
    assert not (runs["ddp"] / f"status_rank{rank}.jsonl").exists()


@pytest.mark.distributed
@pytest.mark.parametrize("rank", RANKS)
def test_several_optimizers_are_refused_on_every_rank(runs: dict[str, Path], rank: int) -> None:
    assert json.loads((runs["ddp"] / f"refused_rank{rank}.json").read_text()) == {"two_optimizers": None}
    refused = json.loads((runs["commsched"] / f"refused_rank{rank}.json").read_text())["two_optimizers"]
    assert refused is not None and "one optimizer" in refused and "returned 2" in refused


# ------------------------------------------------------------------------------ in process, no process group
def test_trainer_finds_the_strategy_by_name() -> None:
    trainer = Trainer(strategy="commsched", accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy) is CommschedStrategy
    assert trainer.strategy.commsched_strategy == commsched.Strategy()
    knobs = commsched.Strategy(bucket_cap_mb=5, overlap_forward=False)
    assert Trainer(strategy=CommschedStrategy(knobs), accelerator="cpu", devices=2,
                   logger=False).strategy.commsched_strategy is knobs


def test_torch_ddp_options_are_refused_with_their_replacement() -> None:
    with pytest.raises(TypeError, match=r"torch DDP's arguments \['find_unused_parameters'\].*commsched.Strategy"):
        CommschedStrategy(find_unused_parameters=True)
    with pytest.raises(TypeError, match=r"ddp_comm_hook"):
        CommschedStrategy(ddp_comm_hook=lambda *args: None)
    with pytest.raises(TypeError, match="must be a commsched.Strategy"):
        CommschedStrategy(strategy="ddp")  # type: ignore[arg-type]


def test_parameter_servers_are_refused() -> None:
    with pytest.raises(ValueError, match="parameter-server backend.*commsched.AllReduce"):
        CommschedStrategy(commsched.Strategy(backend=commsched.ParameterServer(num_servers=1)))


def test_status_outside_fit_says_when_it_is_available() -> None:
    with pytest.raises(RuntimeError, match="during fit"):
        CommschedStrategy().commsched_status()


def test_clipping_scaled_gradients_is_refused() -> None:
    """With a GradScaler the gradients Lightning clips would still be scaled (commsched unscales in step())."""

    class Prepared:
        param_groups: list = []

        def synchronize(self) -> None:
            raise AssertionError("refused before waiting")

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    prepared = Prepared()
    clip = _settled_clipping(plugin, prepared)
    clip(prepared, 0.0)  # no clipping asked: nothing to refuse
    with pytest.raises(ValueError, match="GradScaler.*bf16-mixed"):
        clip(prepared, 1.0)
