"""A hand-written accelerate training loop, as accelerate's examples write it, on CPU ranks.

    python -m torch.distributed.run --nproc-per-node 2 --master-port PORT \
        tests/integrations/hf_accelerate_script.py --wrapper ddp|commsched --out DIR

The tiny GPT-2 and token data of ``hf_script.py``; the LR scheduler is made
before ``accelerator.prepare`` (accelerate's usual order) and prepared with
the rest; every step goes through ``accelerator.accumulate(model)``, with
``accelerator.backward``, ``accelerator.clip_grad_norm_`` on the steps that
synchronise, ``optimizer.step()``, ``lr_scheduler.step()`` and
``optimizer.zero_grad()``. The two wrappers differ in the one line that makes
the Accelerator. Writes, under ``DIR/accelerate``: each rank's losses and
gradient norms (``losses_rank<r>.json``), the final state dict (rank 0,
``model.safetensors``) and what commsched reports (``status_rank<r>.json``).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401 - before the process group: see commsched/testing/launch.py
from accelerate import Accelerator
from accelerate.utils import set_seed
from hf_script import ACCUMULATION, PER_DEVICE_BATCH, SEED, SEQUENCE, WATCHDOG_S, TokenDataset, commsched_report
from safetensors.torch import save_file
from script_support import end_here
from transformers import AutoModelForCausalLM, GPT2Config, get_linear_schedule_with_warmup

from commsched.integrations.huggingface import CommschedAccelerator

OPTIMIZER_STEPS = 10
SAMPLES = 48
"""12 micro-batches per epoch per rank: 6 optimizer steps an epoch, so the loop crosses an epoch."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wrapper", choices=["ddp", "commsched"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


def main() -> None:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    args = parse_args()
    out = args.out / "accelerate"
    out.mkdir(parents=True, exist_ok=True)
    set_seed(SEED)

    accelerator_class = CommschedAccelerator if args.wrapper == "commsched" else Accelerator  # the one difference
    accelerator = accelerator_class(cpu=True, gradient_accumulation_steps=ACCUMULATION)

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0,
                        eos_token_id=0)
    model = AutoModelForCausalLM.from_config(config)
    dataset = TokenDataset(SAMPLES, config.vocab_size, SEQUENCE, seed=SEED + 1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=PER_DEVICE_BATCH, shuffle=True,
                                         generator=torch.Generator().manual_seed(SEED))
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "ln_" in n]
    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or "ln_" in n)]
    # fused=True, as the Trainer's default optimizer ("adamw_torch_fused"): commsched's per-bucket updates
    # run torch's fused kernel, and the attention's key bias, whose gradient is rounding noise that Adam
    # scales up to full steps, would otherwise differ by the two kernels' last bits.
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-3, fused=True)
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2,
                                                   num_training_steps=OPTIMIZER_STEPS * accelerator.num_processes)

    model, optimizer, loader, lr_scheduler = accelerator.prepare(model, optimizer, loader, lr_scheduler)

    record: dict[str, list[float]] = {"loss": [], "grad_norm": [], "lr": []}
    steps = 0
    model.train()
    while steps < OPTIMIZER_STEPS:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    record["grad_norm"].append(accelerator.clip_grad_norm_(model.parameters(), 1.0).item())
                    record["lr"].append(lr_scheduler.get_last_lr()[0])
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            record["loss"].append(loss.item())
            if accelerator.sync_gradients:
                steps += 1
                if steps == OPTIMIZER_STEPS:
                    break

    rank = accelerator.process_index
    (out / f"losses_rank{rank}.json").write_text(json.dumps(record, indent=1))
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}, out / "model.safetensors")
    report = {"rank": rank, "optimizer_steps": steps, "micro_steps": len(record["loss"]),
              "model_wrapped": type(model).__name__, **commsched_report(model)}
    (out / f"status_rank{rank}.json").write_text(json.dumps(report, indent=1))
    end_here()


if __name__ == "__main__":
    main()
