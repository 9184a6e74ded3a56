"""Lightning's demo transformer trained under torch DDP or commsched; tests/integrations/test_lightning.py compares.

    python -m torch.distributed.run --nproc-per-node 2 --master-port PORT \\
        tests/integrations/lightning_script.py --strategy ddp|commsched --out DIR

The two runs differ only in ``Trainer(strategy=...)``. Each rank writes to DIR:
``losses_rank{R}.jsonl`` (every micro-batch's loss and every validation's
metrics), ``status_rank{R}.jsonl`` (commsched's forward overlap at the end of
each fit, commsched only), ``results_rank{R}.json`` (``trainer.test`` and
``trainer.validate``), ``refused_rank{R}.json`` (the error a model with two
optimizers gets, None where it trains), and checkpoints under ``ckpt1/``, ``ckpt2/``,
``final.ckpt``, ``manual.ckpt``.

What runs: a fit of 8 optimizer steps (bf16 autocast, 2 micro-batches per step,
gradient clipping, a per-step LR schedule, validation after each epoch, a
checkpoint every 4 steps), a second Trainer resuming from the step-8
checkpoint for 6 more steps, ``test`` and ``validate``; then Lightning's
manual-optimization demo model for 6 steps, and the same with two optimizers.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import ManualOptimBoringModel, RandomDataset
from lightning.pytorch.demos.transformer import LightningTransformer, Transformer
from script_support import end_here
from torch.utils.data import DataLoader, Dataset

import commsched.integrations.lightning  # noqa: F401 - registers strategy="commsched"

VOCAB, LENGTH, BATCH = 32, 8, 4


class Tokens(Dataset):
    """Synthetic token sequences (no download): ``(inputs, target)`` with the target shifted by one."""

    def __init__(self, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, VOCAB, (count, LENGTH + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index, :-1], self.data[index, 1:]


class TinyTransformer(LightningTransformer):
    """Lightning's demo language model, small, with an LR schedule, validation and test steps."""

    def __init__(self) -> None:
        super().__init__(vocab_size=VOCAB)
        self.model = Transformer(vocab_size=VOCAB, ninp=16, nhead=2, nhid=32, nlayers=1, dropout=0.1)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, target = batch
        return torch.nn.functional.nll_loss(self(inputs, target), target.reshape(-1))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def prepare_data(self) -> None:
        """The demo downloads WikiText-2 here; this one trains on synthetic tokens."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Tokens(64, seed=1), batch_size=BATCH, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Tokens(16, seed=2), batch_size=BATCH)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(Tokens(16, seed=3), batch_size=BATCH)


class TwoOptimizers(ManualOptimBoringModel):
    """Lightning's manual-optimization demo with an optimizer for the weight and one for the bias."""

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD([self.layer.weight], lr=0.1), torch.optim.SGD([self.layer.bias], lr=0.1)]

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        optimizers = self.optimizers()
        loss = self.step(batch)
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in optimizers:
            optimizer.step()
        return loss


class Record(Callback):
    """Every training micro-batch's loss, validation metrics and commsched's overlap, per rank."""

    def __init__(self, out: Path, phase: str) -> None:
        self.phase = phase
        self.losses = out / f"losses_rank{int(os.environ['RANK'])}.jsonl"
        self.status = out / f"status_rank{int(os.environ['RANK'])}.jsonl"

    def _write(self, path: Path, record: dict[str, Any]) -> None:
        with path.open("a") as f:
            f.write(json.dumps({"phase": self.phase, **record}) + "\n")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self._write(self.losses, {"step": trainer.global_step, "batch": batch_idx, "loss": float(loss)})

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            val_loss = float(trainer.callback_metrics["val_loss"])
            self._write(self.losses, {"step": trainer.global_step, "val_loss": val_loss})

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        commsched_status = getattr(trainer.strategy, "commsched_status", None)
        if commsched_status is not None:
            state = commsched_status()
            self._write(self.status, {"overlapping": state.overlapping, "iterations": state.iterations,
                                      "overlap_off_reason": state.overlap_off_reason})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["ddp", "commsched"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # torch runs nn.Transformer's layers in eval mode on a fused "fast path", but not where modules
    # carry forward hooks (commsched's forward gates, during fit): the same math with other roundings.
    # Both runs take the regular path, so that validation during fit can be compared exactly.
    torch.backends.mha.set_fastpath_enabled(False)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    def trainer(phase: str, **kwargs: Any) -> Trainer:
        settings: dict[str, Any] = dict(
            accelerator="cpu", devices=2, precision="bf16-mixed", logger=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=out, limit_val_batches=2, num_sanity_val_steps=1,
        )
        settings.update(kwargs)
        callbacks = [Record(out, phase), *settings.pop("callbacks", [])]
        return Trainer(
            strategy=args.strategy,  # "ddp" or "commsched": the one difference between the two runs
            callbacks=callbacks, **settings,
        )

    def checkpoints(directory: str) -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=out / directory, every_n_train_steps=4, save_top_k=-1)

    training = dict(accumulate_grad_batches=2, gradient_clip_val=0.5)

    seed_everything(1234)
    model = TinyTransformer()
    trainer("fit1", max_steps=8, callbacks=[checkpoints("ckpt1")], **training).fit(model)

    seed_everything(99)  # another initialisation: the resumed run must take everything from the checkpoint
    model = TinyTransformer()
    resumed = trainer("fit2", max_steps=14, callbacks=[checkpoints("ckpt2")], **training)
    resumed.fit(model, ckpt_path=out / "ckpt1" / "epoch=1-step=8.ckpt")
    resumed.save_checkpoint(out / "final.ckpt")
    results = {"test": resumed.test(model, verbose=False), "validate": resumed.validate(model, verbose=False)}
    (out / f"results_rank{int(os.environ['RANK'])}.json").write_text(json.dumps(results))

    seed_everything(7)
    manual = trainer("manual", max_steps=6, limit_val_batches=0, enable_checkpointing=False)
    manual.fit(ManualOptimBoringModel(), DataLoader(RandomDataset(32, 64), batch_size=4))
    manual.save_checkpoint(out / "manual.ckpt")

    # What commsched refuses: torch DDP trains it, commsched raises at setup on every rank.
    refused: dict[str, str | None] = {}
    try:
        trainer("two_optimizers", max_steps=2, limit_val_batches=0, enable_checkpointing=False).fit(
            TwoOptimizers(), DataLoader(RandomDataset(32, 16), batch_size=4))
        refused["two_optimizers"] = None
    except ValueError as error:
        refused["two_optimizers"] = str(error)
    (out / f"refused_rank{int(os.environ['RANK'])}.json").write_text(json.dumps(refused))
    end_here()


if __name__ == "__main__":
    main()
