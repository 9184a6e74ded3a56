"""Causal language modelling with transformers' Trainer, as its example scripts do, on CPU ranks.

    python -m torch.distributed.run --nproc-per-node 2 --master-port PORT \
        tests/integrations/hf_script.py --wrapper ddp|commsched --phase train|resume --out DIR

A tiny GPT-2 built from its config, a synthetic token dataset, gradient
accumulation, gradient clipping, a linear schedule with warmup, a checkpoint
every ``SAVE_STEPS`` steps. ``--phase train`` trains ``MAX_STEPS`` steps from
scratch; ``--phase resume`` starts a fresh process that resumes from the
checkpoint at step ``SAVE_STEPS`` and trains to the end. The two wrappers
differ in the one line that makes the Trainer. Writes, under
``DIR/<phase>``: the log history (rank 0), the final model (``final/``), and
per rank what commsched reports for the model (``status_rank<r>.json``).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401 - before the process group: see commsched/testing/launch.py
import torch.distributed as dist
from script_support import end_here
from transformers import AutoModelForCausalLM, GPT2Config, Trainer, TrainingArguments, set_seed

import commsched
from commsched.integrations.huggingface import CommschedTrainer

SEED = 1234
MAX_STEPS = 12
SAVE_STEPS = 6
ACCUMULATION = 2
PER_DEVICE_BATCH = 2
SEQUENCE = 16
WATCHDOG_S = 200
"""A rank still running after this long prints every thread's stack and exits (the test waits 240 s)."""
SAMPLES = 80
"""Micro-batches per epoch per rank: 20, so 10 steps an epoch: the checkpoint at step 6 is mid-epoch,
and the run crosses an epoch boundary."""


class TokenDataset(torch.utils.data.Dataset):
    """Random token sequences with a learnable pattern (each token predicts the next)."""

    def __init__(self, samples: int, vocab_size: int, length: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, vocab_size, (samples, 1), generator=generator)
        steps = torch.randint(1, 4, (samples, 1), generator=generator)
        positions = torch.arange(length).unsqueeze(0)
        noise = (torch.rand(samples, length, generator=generator) < 0.1) * torch.randint(
            0, vocab_size, (samples, length), generator=generator)
        self.tokens = (starts + steps * positions + noise) % vocab_size

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def commsched_report(model: torch.nn.Module) -> dict[str, object]:
    """What commsched reports for ``model``: whether it prepared it, forward overlap, the reductions."""
    if not isinstance(model, commsched.CommschedModule):
        return {"prepared": False}
    status = commsched.status(model)
    return {
        "prepared": True,
        "overlapping": status.overlapping,
        "overlap_off_reason": status.overlap_off_reason,
        "lifecycle": status.lifecycle.value,
        "iterations": status.iterations,
        "bucket_bytes": sum(bucket.wire_nbytes for bucket in status.buckets),
        "bytes_issued_per_iteration": [
            figures.bytes_issued for figures in (status.previous_iteration, status.current_iteration)
            if figures is not None
        ],
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wrapper", choices=["ddp", "commsched"], required=True)
    parser.add_argument("--phase", choices=["train", "resume"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


def main() -> None:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    args = parse_args()
    run_dir = args.out / "run"
    phase_dir = args.out / args.phase
    set_seed(SEED)

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = AutoModelForCausalLM.from_config(config)
    train_dataset = TokenDataset(SAMPLES, config.vocab_size, SEQUENCE, seed=SEED)

    training_args = TrainingArguments(
        output_dir=str(run_dir),
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=PER_DEVICE_BATCH,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=MAX_STEPS,
        learning_rate=3e-3,
        weight_decay=0.01,
        lr_scheduler_type="linear",
        warmup_steps=3,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        seed=SEED,
        data_seed=SEED,
        dataloader_num_workers=0,
        report_to="none",
        disable_tqdm=True,
    )

    trainer_class = CommschedTrainer if args.wrapper == "commsched" else Trainer  # the one difference
    trainer = trainer_class(model=model, args=training_args, train_dataset=train_dataset)

    resume = str(run_dir / f"checkpoint-{SAVE_STEPS}") if args.phase == "resume" else None
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(str(phase_dir / "final"))

    rank = dist.get_rank()
    phase_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (phase_dir / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    steps_here = MAX_STEPS - (SAVE_STEPS if resume else 0)
    report = {"rank": rank, "optimizer_steps": steps_here, "global_step": trainer.state.global_step,
              "model_wrapped": type(trainer.model_wrapped).__name__,
              "accelerator": type(trainer.accelerator).__name__, **commsched_report(trainer.model)}
    (phase_dir / f"status_rank{rank}.json").write_text(json.dumps(report, indent=1))
    end_here()


if __name__ == "__main__":
    main()
