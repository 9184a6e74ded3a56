"""Hugging Face: `CommschedTrainer` and `CommschedAccelerator` train as transformers' and accelerate's own do on DDP.

The scripts beside this file are launched with ``torch.distributed.run`` on two
CPU ranks (gloo), once with the stock class and once with commsched's, the
only difference between the two runs:

- ``hf_script.py``: transformers' Trainer on a tiny GPT-2, with gradient
  accumulation, ``max_grad_norm``, a linear schedule with warmup and a
  checkpoint at step 6; a second launch resumes from that checkpoint;
- ``hf_accelerate_script.py``: a hand-written ``accelerator.accumulate`` loop.

Every logged loss, gradient norm and learning rate, and the final weights, must
match DDP's; forward overlap must be on at the end, and commsched must have
run exactly one synchronised backward pass (every bucket on the wire once) per
optimizer step, none for the micro-batches accumulated under ``no_sync``.
The refusals are checked on accelerators whose state is made up.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install commsched[hf])")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install commsched[hf])")

from accelerate.utils import DistributedDataParallelKwargs, DistributedType  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import commsched  # noqa: E402
from commsched.integrations.huggingface import CommschedAccelerator  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LAUNCH_TIMEOUT_S = 240
MAX_STEPS, SAVE_STEPS = 12, 6
ACCELERATE_STEPS = 10
WRAPPERS = ("ddp", "commsched")


# ------------------------------------------------------------------ launching
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch_together(launches: dict[str, list[str]], logs: Path) -> None:
    """Run each ``torch.distributed.run`` launch at once; all must finish, with status 0, in time."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", HF_HOME=str(logs / "hf_home"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    running = {}
    for name, argv in launches.items():
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *argv]
        log = (logs / f"{name}.log").open("w")
        running[name] = (subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True), log)
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    failures = []
    for name, (process, log) in running.items():
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            failures.append(f"{name}: still running after {LAUNCH_TIMEOUT_S} s (a hang), killed")
        log.close()
        if process.returncode not in (0, None) and not any(f.startswith(f"{name}:") for f in failures):
            failures.append(f"{name}: exit status {process.returncode}")
    if failures:
        tails = "\n".join(f"--- {name}.log (end)\n" + (logs / f"{name}.log").read_text()[-4000:]
                          for name in running)
        pytest.fail("; ".join(failures) + "\n" + tails)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Every launch, two stages of four and two concurrent launches; returns their output folder."""
    out = tmp_path_factory.mktemp("hf")
    trainer, accelerate = str(HERE / "hf_script.py"), str(HERE / "hf_accelerate_script.py")
    first = {f"trainer_train_{w}": [trainer, "--wrapper", w, "--phase", "train", "--out", str(out / w)]
             for w in WRAPPERS}
    first |= {f"accelerate_{w}": [accelerate, "--wrapper", w, "--out", str(out / w)] for w in WRAPPERS}
    _launch_together(first, out)
    # A fresh process resumes from the checkpoint the first launch saved at step SAVE_STEPS.
    _launch_together({f"trainer_resume_{w}": [trainer, "--wrapper", w, "--phase", "resume", "--out", str(out / w)]
                      for w in WRAPPERS}, out)
    return out


# ------------------------------------------------------------------ comparing
def _logged(out: Path, wrapper: str, phase: str, key: str) -> list[float]:
    history = json.loads((out / wrapper / phase / "log_history.json").read_text())
    return [entry[key] for entry in history if key in entry and "train_runtime" not in entry]


def _assert_close_lists(ours: list[float], reference: list[float], rel: float, what: str) -> None:
    assert len(ours) == len(reference) and reference, f"{what}: {len(ours)} values against {len(reference)}"
    assert ours == pytest.approx(reference, rel=rel, abs=1e-12), what


def _assert_same_weights(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], what: str) -> None:
    assert ours.keys() == reference.keys() and reference, what
    for name, value in reference.items():
        scale = value.abs().max().clamp_min(1e-12)
        error = ((ours[name] - value).abs().max() / scale).item()
        assert error <= 1e-4, f"{what}: {name} differs by {error:.2e} of its largest value"


def _statuses(out: Path, wrapper: str, phase: str) -> list[dict]:
    return [json.loads((out / wrapper / phase / f"status_rank{rank}.json").read_text()) for rank in range(2)]


def _assert_overlap_and_one_reduction_per_step(status: dict, optimizer_steps: int) -> None:
    assert status["prepared"], f"the model was not prepared by commsched: {status}"
    assert status["overlapping"] and status["overlap_off_reason"] is None, status
    # One synchronised backward pass per optimizer step: the accumulated micro-batches ran under no_sync.
    assert status["optimizer_steps"] == optimizer_steps and status["iterations"] == optimizer_steps, status
    # Each of the last two put every bucket on the wire once, whole.
    assert status["bytes_issued_per_iteration"] == [status["bucket_bytes"]] * 2, status


# ------------------------------------------------------------------ Trainer
@pytest.mark.distributed
@pytest.mark.parametrize("phase", ["train", "resume"])
def test_trainer_logs_what_ddp_logs(runs, phase):
    for key in ("loss", "grad_norm", "learning_rate"):
        _assert_close_lists(_logged(runs, "commsched", phase, key), _logged(runs, "ddp", phase, key), 1e-5,
                            f"{phase}: logged {key}")
    assert len(_logged(runs, "ddp", phase, "loss")) == MAX_STEPS


@pytest.mark.distributed
def test_trainer_weights_match_ddp(runs):
    for path in ("train/final", "run/checkpoint-6", "resume/final"):
        _assert_same_weights(load_file(runs / "commsched" / path / "model.safetensors"),
                             load_file(runs / "ddp" / path / "model.safetensors"), path)


@pytest.mark.distributed
def test_trainer_resumes_where_the_run_was(runs):
    """The resumed launch logs the uninterrupted run's last steps and ends with its weights."""
    for key in ("loss", "grad_norm", "learning_rate"):
        _assert_close_lists(_logged(runs, "commsched", "resume", key)[SAVE_STEPS:],
                            _logged(runs, "commsched", "train", key)[SAVE_STEPS:], 1e-5, f"resumed {key}")
    _assert_same_weights(load_file(runs / "commsched/resume/final/model.safetensors"),
                         load_file(runs / "commsched/train/final/model.safetensors"), "resumed final weights")


@pytest.mark.distributed
def test_trainer_overlaps_and_reduces_once_per_step(runs):
    for phase, steps in (("train", MAX_STEPS), ("resume", MAX_STEPS - SAVE_STEPS)):
        for status in _statuses(runs, "commsched", phase):
            assert status["accelerator"] == "CommschedAccelerator", status
            _assert_overlap_and_one_reduction_per_step(status, steps)
        for status in _statuses(runs, "ddp", phase):
            assert status["model_wrapped"] == "DistributedDataParallel", status


# ------------------------------------------------------------------ accelerate
@pytest.mark.distributed
def test_accelerate_loop_matches_ddp(runs):
    for rank in range(2):
        ours, reference = (json.loads((runs / w / "accelerate" / f"losses_rank{rank}.json").read_text())
                           for w in ("commsched", "ddp"))
        for key in ("loss", "grad_norm", "lr"):
            _assert_close_lists(ours[key], reference[key], 1e-5, f"rank {rank}: {key}")
        assert len(reference["loss"]) == 2 * ACCELERATE_STEPS
    _assert_same_weights(load_file(runs / "commsched/accelerate/model.safetensors"),
                         load_file(runs / "ddp/accelerate/model.safetensors"), "accelerate final weights")


@pytest.mark.distributed
def test_accelerate_loop_overlaps_and_reduces_once_per_step(runs):
    for status in _statuses(runs, "commsched", "accelerate"):
        _assert_overlap_and_one_reduction_per_step(status, ACCELERATE_STEPS)
        assert status["model_wrapped"].startswith("Commsched") and status["micro_steps"] == 2 * ACCELERATE_STEPS
    for status in _statuses(runs, "ddp", "accelerate"):
        assert status["model_wrapped"] == "DistributedDataParallel", status


# ------------------------------------------------------------------ refusals
def _accelerator(kind: DistributedType, processes: int = 2, ddp_handler=None, **state) -> CommschedAccelerator:
    """A CommschedAccelerator over a made-up accelerate state (nothing is started)."""
    accelerator = CommschedAccelerator.__new__(CommschedAccelerator)
    made_up = {"distributed_type": kind, "is_fsdp2": False, "parallelism_config": None,
               "use_distributed": processes > 1, "num_processes": processes}
    accelerator.state = SimpleNamespace(**(made_up | state))
    accelerator.ddp_handler = ddp_handler
    return accelerator


@pytest.mark.parametrize(("kind", "named"), [
    (DistributedType.DEEPSPEED, "DeepSpeed"), (DistributedType.FSDP, "FSDP"),
    (DistributedType.MEGATRON_LM, "Megatron-LM"), (DistributedType.XLA, "XLA"),
    (DistributedType.MULTI_XPU, "MULTI_XPU"),
])
def test_other_distributed_kinds_are_refused(kind, named):
    with pytest.raises(ValueError, match=named) as raised:
        _accelerator(kind)._commsched_setup(None)
    assert "accelerate's own Accelerator" in str(raised.value)


def test_sharding_parallelism_is_refused():
    config = SimpleNamespace(tp_enabled=True, cp_enabled=False, sp_enabled=False, dp_shard_enabled=True)
    with pytest.raises(ValueError, match="enables tp, dp_shard"):
        _accelerator(DistributedType.MULTI_GPU, parallelism_config=config)._commsched_setup(None)


def test_parameter_servers_and_ddp_hooks_are_refused():
    with pytest.raises(ValueError, match=r"commsched.serve\(\)"):
        _accelerator(DistributedType.MULTI_CPU)._commsched_setup(
            commsched.Strategy(backend=commsched.ParameterServer(num_servers=1)))
    hooked = DistributedDataParallelKwargs(comm_hook="fp16")
    with pytest.raises(ValueError, match=r"comm_hook.*reduce_dtype"):
        _accelerator(DistributedType.MULTI_CPU, ddp_handler=hooked)._commsched_setup(None)


def test_ddp_settings_carry_over_or_must_agree():
    handler = DistributedDataParallelKwargs(bucket_cap_mb=50, broadcast_buffers=False, find_unused_parameters=True)
    accelerator = _accelerator(DistributedType.MULTI_CPU, ddp_handler=handler)
    accelerator._commsched_setup(None)
    assert accelerator._commsched_active
    assert (accelerator._commsched_strategy.bucket_cap_mb, accelerator._commsched_strategy.broadcast_buffers) == (
        50, False)
    with pytest.raises(ValueError, match="bucket_cap_mb=50 but the commsched strategy has bucket_cap_mb=25"):
        _accelerator(DistributedType.MULTI_CPU, ddp_handler=handler)._commsched_setup(commsched.Strategy())


def test_one_process_is_left_to_accelerate():
    accelerator = _accelerator(DistributedType.NO, processes=1)
    accelerator._commsched_setup(None)
    assert not accelerator._commsched_active


def test_an_optimizer_must_belong_to_one_model_prepared_for_training():
    accelerator = _accelerator(DistributedType.MULTI_CPU)
    accelerator._commsched_setup(None)
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    accelerator._commsched_pending = [first, second]
    both = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    with pytest.raises(ValueError, match="parameters of several models"):
        accelerator._commsched_model_of(both)
    alone = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="belongs to no model prepared for training"):
        accelerator._commsched_model_of(alone)
    assert accelerator._commsched_model_of(torch.optim.SGD(second.parameters(), lr=0.1)) is second


def test_gradients_of_a_model_without_its_optimizer_are_refused():
    accelerator = _accelerator(DistributedType.MULTI_CPU)
    accelerator._commsched_setup(None)
    model = torch.nn.Linear(2, 2)
    accelerator._commsched_pending = [model]
    accelerator._commsched_refuse_unprepared_gradients()  # no gradient yet: fine
    model(torch.ones(1, 2)).sum().backward()
    with pytest.raises(RuntimeError, match="prepared without an optimizer"):
        accelerator._commsched_refuse_unprepared_gradients()
