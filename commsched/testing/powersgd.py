"""PowerSGD in one process, for the tests: what torch's ``powerSGD_hook`` computes, written as plainly
as possible, over every rank's gradient at once.

It keeps the hook's arithmetic (each rank's error added to its gradient, the sums of ``P`` and
``Q``, the division by the world size after them, each rank's error as what it put in less the
result) and draws the first random ``Q`` as the hook does, bucket by bucket. It orthonormalises
with a QR factorisation (whose columns' signs may differ from Gram-Schmidt's, which the result
``P Q^T`` does not see), except where ``orthogonalization_epsilon`` changes the hook's result: up
to rank 2, where the hook divides each column by its norm plus epsilon.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from commsched.strategy import PowerSGD


class ReferencePowerSGD:
    """The averaged, compressed gradients a job of ``world_size`` ranks gets, computed in one process."""

    def __init__(self, settings: PowerSGD, world_size: int):
        self.settings, self.world_size = settings, world_size
        self._rng = np.random.RandomState(settings.random_seed)
        self._errors: dict[tuple[int, int], torch.Tensor] = {}
        self._queries: dict[int, torch.Tensor] = {}
        self.iterations = 0

    def average(self, grads: Sequence[Sequence[torch.Tensor]], bucket_slots: Sequence[Sequence[int]]
                ) -> list[torch.Tensor]:
        """``grads[rank][slot]``: each rank's gradient; ``bucket_slots``: the buckets in use (their
        order sets the draws). Returns each slot's result, the same on every rank."""
        settings, world_size = self.settings, self.world_size
        count = len(grads[0])
        mean = [sum(grads[r][s] for r in range(world_size)) / world_size for s in range(count)]
        compressing = self.iterations >= settings.start_powerSGD_iter
        self.iterations += 1
        if not compressing:
            return mean
        compressed = [s for s in range(count) if self._worth_compressing(grads[0][s])]
        if not settings.warm_start or any(s not in self._queries for s in compressed):
            for slots in bucket_slots:
                generator = torch.Generator().manual_seed(int(self._rng.randint(1_000_000_000)))
                for slot in self._draw_order([s for s in slots if s in compressed], grads[0]):
                    if settings.warm_start and slot in self._queries:
                        continue
                    rows, columns, rank = self._shape(grads[0][slot])
                    self._queries[slot] = torch.randn(columns, rank, generator=generator, dtype=grads[0][slot].dtype)
        result = list(mean)
        for slot in compressed:
            rows, columns, rank = self._shape(grads[0][slot])
            inputs = []
            for r in range(world_size):
                matrix = grads[r][slot].reshape(rows, columns).clone()
                if settings.use_error_feedback and (r, slot) in self._errors:
                    matrix += self._errors[(r, slot)]
                inputs.append(matrix)
            query = self._orthonormal(self._queries[slot])
            p = self._orthonormal(sum(m @ query for m in inputs))
            q = sum(m.T @ p for m in inputs) / world_size
            approximation = p @ q.T
            if settings.use_error_feedback:
                for r in range(world_size):
                    self._errors[(r, slot)] = inputs[r] - approximation
            self._queries[slot] = q
            result[slot] = approximation.reshape(grads[0][slot].shape)
        return result

    def _orthonormal(self, matrix: torch.Tensor) -> torch.Tensor:
        epsilon = self.settings.orthogonalization_epsilon
        if not epsilon or matrix.shape[1] > 2:
            return torch.linalg.qr(matrix)[0]
        columns = []
        for i in range(matrix.shape[1]):
            column = matrix[:, i].clone()
            for previous in columns:
                column = column - (previous @ column) * previous
            columns.append(column / (column.norm() + epsilon))
        return torch.stack(columns, dim=1)

    def _worth_compressing(self, grad: torch.Tensor) -> bool:
        if grad.dim() < 1 or grad.numel() == 0:
            return False
        rows, columns, rank = self._shape(grad)
        return (rows + columns) * rank * self.settings.min_compression_rate < rows * columns

    def _shape(self, grad: torch.Tensor) -> tuple[int, int, int]:
        rows = grad.shape[0]
        columns = grad.numel() // rows
        return rows, columns, min(rows, columns, self.settings.matrix_approximation_rank)

    def _draw_order(self, slots: list[int], grads: Sequence[torch.Tensor]) -> list[int]:
        if not self.settings.batch_tensors_with_same_shape:
            return slots
        shapes: dict[tuple[int, int], list[int]] = {}
        for slot in slots:
            shapes.setdefault(self._shape(grads[slot])[:2], []).append(slot)
        return [slot for group in shapes.values() for slot in group]




def reference_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, compressor: ReferencePowerSGD,
                   loss_of_share: Callable[[int], torch.Tensor], bucket_slots: Sequence[Sequence[int]]) -> None:
    """One step of the single-process reference: each rank's share's gradient, their compressed
    average (``bucket_slots`` by the trainable parameters' slots), ``step()``, ``zero_grad()``."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for rank in range(compressor.world_size):
        optimizer.zero_grad()
        loss_of_share(rank).backward()
        grads.append([p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params])
    for param, average in zip(params, compressor.average(grads, bucket_slots), strict=True):
        param.grad = average
    optimizer.step()
    optimizer.zero_grad()


def bucket_slots_of(prepared: torch.nn.Module) -> list[list[int]]:
    """A prepared model's buckets in use, as slots of its trainable parameters (from `commsched.status`)."""
    import commsched

    names = [name for name, p in prepared.named_parameters() if p.requires_grad]
    slot_of = {name: slot for slot, name in enumerate(names)}
    return [[slot_of[name] for name in bucket.parameters] for bucket in commsched.status(prepared).buckets]
