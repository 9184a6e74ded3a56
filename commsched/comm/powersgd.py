"""PowerSGD: each bucket's large gradients all-reduced as two thin matrices, with error feedback.

[Note: PowerSGD under the schedule] Vogels et al.'s low-rank compression, with the meaning and
defaults of torch DDP's ``powerSGD_hook`` and ``PowerSGDState`` (`commsched.PowerSGD` names the
same settings), so that a DDP user's configuration carries over. For a bucket, from iteration
``start_powerSGD_iter`` on:

1. Each gradient worth compressing (``(n + m) * rank * min_compression_rate < n * m`` for its
   ``n x m`` matrix, the tensor viewed as ``shape[0]`` rows) gets this rank's error of the last
   iteration added (error feedback), and ``P = M Q`` with ``Q`` the last iteration's, made
   orthonormal (warm start; random the first time).
2. One all-reduce carries the bucket's other elements (1-D gradients, matrices too small to pay,
   the flags tail) and every ``P``: the first step, on the bucket's group, in the plan's order.
3. On a communication thread once it is done: the other elements are the average (each rank
   divided its gradients by the world size before, as for any bucket), every ``P`` is made
   orthonormal, ``Q = M^T P`` is all-reduced: the second step, on a group of its own, in the
   order of the first steps (`commsched.comm.two_step.SecondSteps`, shared with the two-step
   all-reduce), so every rank issues the second steps alike whatever order completions came in.
4. When the bucket is waited for: ``M`` becomes ``P Q^T``, the average's approximation, and this
   rank's error is what it put in less its share of that approximation.

Everything is linear in the sum of the ranks' inputs, so the result is torch's up to rounding:
commsched divides before summing, where the hook divides after. Two choices differ from the hook
on purpose:

- State is kept per parameter, not per bucket: a new layout after warm-up (or a tuner's) keeps
  every error and ``Q``. Random ``Q`` are still drawn bucket by bucket, in bucket order, one seed
  per bucket from ``numpy.random.RandomState(random_seed)``, so that with DDP's bucket layout
  the first ``Q`` are DDP's.
- Elements that go uncompressed keep no error: the ranks' errors on them sum to zero, so they
  could change the result only by rounding (the hook keeps one per bucket element).
- A column of ``P`` or ``Q`` that is all zeros stays zero (where the hook divides by its norm,
  which gives NaN): it happens where a matrix's gradient is zero on every rank.

The unit on the wire is the bucket: a matrix is never cut, since its ``P`` and ``Q`` need all of
it (`AllReduceTransport.attach` makes each bucket one partition of its compressed size, which the
credit window counts). Buckets stay capped at the partition size (``Strategy.partition_mb`` or the
cost model's choice), so that a large layer travels alone, the input-side layers go first, and the
compressed all-reduces of several buckets hide behind the backward pass: in buckets of
``bucket_cap_mb`` PowerSGD at rank 16 ran 1.04-1.07x torch DDP with ``powerSGD_hook`` on 2
emulated hosts at 0.1 Gbit/s, capped at the partition size 1.25-1.50x
(docs/records/2026-12-07-powersgd-and-the-arithmetic.md).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from commsched.comm.two_step import SecondStepOperation, SecondSteps
from commsched.layout.buckets import Bucket, BucketSet
from commsched.strategy import PowerSGD

STATE_FORMAT = 1
"""The version of `PowerSGDCompressor.state_dict`'s layout."""


@dataclass(frozen=True)
class _Matrix:
    """One compressed gradient of a bucket: its slot, its place in the bucket and its matrix shape."""

    slot: int
    param: torch.nn.Parameter
    offset: int
    rows: int
    columns: int
    rank: int


@dataclass(frozen=True)
class BucketCompression:
    """How one bucket goes compressed: its matrices, the rest, and the sizes on the wire."""

    matrices: tuple[_Matrix, ...]
    rest: tuple[tuple[int, int], ...]
    """Ranges ``[start, end)`` of the bucket's flat buffer that go uncompressed (the flags tail included)."""
    rest_numel: int
    p_numel: int
    q_numel: int
    numel: int
    """Elements of the bucket uncompressed (its flat buffer)."""

    @property
    def wire_numel(self) -> int:
        """Elements sent per iteration once compressed: the rest and the ``P`` together, then the ``Q``."""
        return self.rest_numel + self.p_numel + self.q_numel


def plan_bucket(bucket: Bucket, slots: Sequence[int], settings: PowerSGD) -> BucketCompression:
    """Which of ``bucket``'s gradients are compressed (``slots``: its parameters' slots)."""
    matrices: list[_Matrix] = []
    for slot, param, offset in zip(slots, bucket.params, bucket.offsets, strict=True):
        if param.dim() < 1 or param.numel() == 0:
            continue
        rows = param.shape[0]
        columns = param.numel() // rows
        rank = min(rows, columns, settings.matrix_approximation_rank)
        if (rows + columns) * rank * settings.min_compression_rate < rows * columns:
            matrices.append(_Matrix(slot, param, offset, rows, columns, rank))
    rest: list[tuple[int, int]] = []
    position = 0
    for matrix in matrices:
        if matrix.offset > position:
            rest.append((position, matrix.offset))
        position = matrix.offset + matrix.rows * matrix.columns
    total = bucket.flat.numel()
    if total > position:
        rest.append((position, total))
    return BucketCompression(
        tuple(matrices), tuple(rest), sum(end - start for start, end in rest),
        sum(m.rows * m.rank for m in matrices), sum(m.columns * m.rank for m in matrices), total)


def orthonormalize(matrix: torch.Tensor, epsilon: float) -> None:
    """Make ``matrix``'s columns orthonormal, in place, as torch's hook does: Gram-Schmidt for
    ranks up to 2 and 16-bit dtypes, else a QR factorisation (whose columns' signs may differ
    from Gram-Schmidt's). A zero column stays zero (see [Note: PowerSGD under the schedule])."""
    columns = matrix.shape[1]
    if columns > 2 and matrix.dtype not in (torch.float16, torch.bfloat16):
        q, _ = torch.linalg.qr(matrix)
        matrix.copy_(q)
        return
    for i in range(columns):
        column = matrix[:, i:i + 1]
        norm = torch.linalg.vector_norm(column)
        if epsilon:
            column.div_(norm + epsilon)
        else:
            column.div_(torch.where(norm > 0, norm, torch.ones_like(norm)))
        if i + 1 < columns:
            rest = matrix[:, i + 1:]
            rest.sub_((column * rest).sum(dim=0, keepdim=True) * column)


class PowerSGDCompressor:
    """One prepared model's PowerSGD state: settings, each parameter's error and ``Q``, the
    iteration, and the figures `commsched.status` reports."""

    def __init__(self, settings: PowerSGD, world_size: int, second_steps: SecondSteps):
        """``second_steps``: the queue of the exchange group, where the ``Q`` are all-reduced."""
        import numpy as np  # as torch's hook: its seeds, so that the first Q are DDP's

        self.settings = settings
        self.world_size = world_size
        self._second_steps = second_steps
        self._rng = np.random.RandomState(settings.random_seed)
        self.errors: dict[int, torch.Tensor] = {}
        """Per slot of a compressed gradient: this rank's error, in the bucket's scale (divided by
        the world size), as a matrix."""
        self.queries: dict[int, torch.Tensor] = {}
        """Per slot of a compressed gradient: the last iteration's averaged ``Q`` (columns x rank)."""
        self.active = False
        """Whether this iteration's buckets go compressed."""
        self.iterations = 0
        """Synchronised iterations begun, those of a run this one resumed included."""
        self._plans: dict[int, BucketCompression] = {}
        self._bucket_set: BucketSet | None = None
        self.bytes_sent = 0
        """Bytes this rank put on the wire for compressed buckets, since the start."""
        self.bytes_uncompressed = 0
        """What those buckets would have taken uncompressed."""

    # ------------------------------------------------------------------ layout and iterations
    def attach(self, bucket_set: BucketSet) -> dict[int, BucketCompression]:
        """A new layout: each bucket's compression, by bucket index."""
        self._bucket_set = bucket_set
        self._plans = {index: plan_bucket(bucket, slots, self.settings)
                       for index, (bucket, slots) in enumerate(zip(bucket_set.buckets, bucket_set.bucket_slots,
                                                                   strict=True))}
        return self._plans

    def begin_iteration(self) -> None:
        """A synchronised iteration starts: compressed once ``start_powerSGD_iter`` have gone
        uncompressed (counted here, so that a resumed run goes on counting); random ``Q`` drawn
        where there are none yet (every iteration without warm start), bucket by bucket in
        bucket order."""
        self.active = self.iterations >= self.settings.start_powerSGD_iter
        self.iterations += 1
        if not self.active or self._bucket_set is None:
            return
        if self.settings.warm_start and all(m.slot in self.queries for plan in self._plans.values()
                                            for m in plan.matrices):
            return
        for index in range(len(self._bucket_set.buckets)):
            plan = self._plans[index]
            seed = int(self._rng.randint(1_000_000_000))
            generator = torch.Generator().manual_seed(seed)
            for matrix in self._ordered_for_draws(plan.matrices):
                if self.settings.warm_start and matrix.slot in self.queries:
                    continue
                query = torch.randn(matrix.columns, matrix.rank, generator=generator, dtype=matrix.param.dtype)
                self.queries[matrix.slot] = query.to(matrix.param.device)

    def _ordered_for_draws(self, matrices: Sequence[_Matrix]) -> list[_Matrix]:
        """The order the hook draws its random ``Q`` in: the bucket's order, or, with
        ``batch_tensors_with_same_shape``, grouped by shape in the order shapes first appear."""
        if not self.settings.batch_tensors_with_same_shape:
            return list(matrices)
        shapes: dict[tuple[int, int], list[_Matrix]] = {}
        for matrix in matrices:
            shapes.setdefault((matrix.rows, matrix.columns), []).append(matrix)
        return [matrix for group in shapes.values() for matrix in group]

    def compressed_slots(self) -> frozenset[int]:
        """The slots of the gradients that go compressed in the layout in use."""
        return frozenset(m.slot for plan in self._plans.values() for m in plan.matrices)

    def compresses(self, bucket_index: int) -> bool:
        """Whether bucket ``bucket_index`` goes compressed this iteration (it has a matrix worth it)."""
        return self.active and bool(self._plans[bucket_index].matrices)

    # ------------------------------------------------------------------ one bucket
    def reduce(self, bucket: Bucket, group: dist.ProcessGroup, what: str) -> PowerSGDReduction:
        """Start the compressed all-reduce of ``bucket`` (already divided by the world size)."""
        plan = self._plans[bucket.index]
        self.bytes_sent += plan.wire_numel * bucket.flat.element_size()
        self.bytes_uncompressed += plan.numel * bucket.flat.element_size()
        return PowerSGDReduction(self, bucket, plan, group, what)

    def matrix_of(self, bucket: Bucket, matrix: _Matrix) -> torch.Tensor:
        """``matrix``'s gradient in ``bucket``, on its wire buffer: the compression's writes never
        look like the user's to the guard that reads the gradients' version counter."""
        return bucket.wire[matrix.offset:matrix.offset + matrix.rows * matrix.columns].view(matrix.rows, matrix.columns)

    def query_of(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s ``Q`` for this iteration, orthonormal (warm: last iteration's, made so again)."""
        query = self.queries[slot]
        orthonormalize(query, self.settings.orthogonalization_epsilon)
        return query

    @property
    def second_steps(self) -> SecondSteps:
        return self._second_steps

    def describe(self) -> str:
        """For `commsched.status`: the settings in use, and the bytes saved so far."""
        settings = self.settings
        when = "now" if self.active else f"from iteration {settings.start_powerSGD_iter}"
        saved = ""
        if self.bytes_sent:
            saved = f": {compression_ratio(self.bytes_sent, self.bytes_uncompressed):.1f}x fewer bytes so far"
        return f"PowerSGD rank {settings.matrix_approximation_rank} {when}{saved}"

    def continue_from(self, iterations: int, generator_state: Any) -> None:
        """Go on from a torch ``PowerSGDState``: its iteration count and its seeds' generator."""
        self.iterations = iterations
        self._rng.set_state(generator_state)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, rank: int) -> dict[str, Any]:
        """This rank's state, for a resume that goes on exactly: its errors (they differ by rank),
        the ``Q`` (alike on every rank), the iterations so far and the seeds' generator."""
        return {"format": STATE_FORMAT, "rank": rank, "world_size": self.world_size, "iterations": self.iterations,
                "errors": {slot: e.clone() for slot, e in self.errors.items()},
                "queries": {slot: q.clone() for slot, q in self.queries.items()}, "rng": self._rng.get_state()}

    def load_state_dict(self, state: dict[str, Any], rank: int) -> None:
        """Resume from `state_dict`'s ``state``. Another rank's errors are not this rank's: they are
        dropped, with a warning (the ``Q`` and the iterations still resume)."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a commsched PowerSGD state of format {STATE_FORMAT}: got "
                             f"{state.get('format') if isinstance(state, dict) else type(state).__name__!r}")
        if state["world_size"] != self.world_size:
            raise ValueError(f"this PowerSGD state was saved among {state['world_size']} ranks and is loaded among "
                             f"{self.world_size}: its Q and errors hold for that world size only; resume among "
                             f"{state['world_size']} ranks, or drop the 'commsched_powersgd' entry to start "
                             "compressing afresh")
        self.iterations = int(state["iterations"])
        self.queries = {int(slot): q.clone() for slot, q in state["queries"].items()}
        self._rng.set_state(state["rng"])
        if state["rank"] == rank:
            self.errors = {int(slot): e.clone() for slot, e in state["errors"].items()}
            return
        self.errors = {}
        warnings.warn(
            f"rank {rank} loaded the PowerSGD state rank {state['rank']} saved: the error feedback is each rank's own, "
            "so it starts from zero here and the resumed run differs slightly from an uninterrupted one. Save "
            "optimizer.state_dict() on every rank (or with torch.distributed.checkpoint) for an exact resume.",
            stacklevel=3)


class PowerSGDReduction(SecondStepOperation):
    """One bucket's compressed all-reduce (see [Note: PowerSGD under the schedule]): a handle
    whose ``wait`` leaves the averaged approximation in the bucket."""

    def __init__(self, compressor: PowerSGDCompressor, bucket: Bucket, plan: BucketCompression,
                 group: dist.ProcessGroup, what: str):
        super().__init__(compressor.second_steps, what)
        self._compressor, self._bucket, self._plan = compressor, bucket, plan
        settings = compressor.settings
        flat = bucket.wire  # the gradients' memory (compression has no reduce_dtype): see `matrix_of`
        self._first_buffer = torch.empty(plan.rest_numel + plan.p_numel, dtype=flat.dtype, device=flat.device)
        self._q_buffer = torch.empty(plan.q_numel, dtype=flat.dtype, device=flat.device)
        self._ps: list[torch.Tensor] = []
        self._qs: list[torch.Tensor] = []
        position = 0
        for start, end in plan.rest:
            self._first_buffer[position:position + end - start].copy_(flat[start:end])
            position += end - start
        q_position = 0
        for matrix in plan.matrices:
            m = compressor.matrix_of(bucket, matrix)
            if settings.use_error_feedback:
                error = compressor.errors.get(matrix.slot)
                if error is not None:
                    m.add_(error)
                    error.copy_(m)  # what this rank put in; its share of the result comes off at wait()
                else:
                    compressor.errors[matrix.slot] = m.clone()
            p = self._first_buffer[position:position + matrix.rows * matrix.rank].view(matrix.rows, matrix.rank)
            torch.matmul(m, compressor.query_of(matrix.slot), out=p)
            self._ps.append(p)
            self._qs.append(self._q_buffer[q_position:q_position + matrix.columns * matrix.rank]
                            .view(matrix.columns, matrix.rank))
            position += matrix.rows * matrix.rank
            q_position += matrix.columns * matrix.rank
        self._finished = False
        self._first_issued(dist.all_reduce(self._first_buffer, group=group, async_op=True), self._compute_queries)

    def _compute_queries(self) -> None:
        """On a communication thread: the rest back into the bucket, ``Q = M^T P`` from the summed ``P``."""
        flat, position = self._bucket.wire, 0
        for start, end in self._plan.rest:
            flat[start:end].copy_(self._first_buffer[position:position + end - start])
            position += end - start
        # The P summed here are the hook's divided by the world size: so is the epsilon added to their norms.
        epsilon = self._compressor.settings.orthogonalization_epsilon / self._compressor.world_size
        for matrix, p, q in zip(self._plan.matrices, self._ps, self._qs, strict=True):
            orthonormalize(p, epsilon)
            torch.matmul(self._compressor.matrix_of(self._bucket, matrix).T, p, out=q)

    def _second_work(self, group: dist.ProcessGroup) -> dist.Work:
        """All-reduce the ``Q`` on the exchange group."""
        return dist.all_reduce(self._q_buffer, group=group, async_op=True)

    def wait(self, timeout_s: float) -> None:
        if self._finished:
            return
        self._wait_steps(timeout_s, "the first step (rest and P)", "the second step (Q)")
        self._decompress()
        self._finished = True

    def _decompress(self) -> None:
        compressor = self._compressor
        share = 1.0 / compressor.world_size
        feedback = compressor.settings.use_error_feedback
        for matrix, p, q in zip(self._plan.matrices, self._ps, self._qs, strict=True):
            m = compressor.matrix_of(self._bucket, matrix)
            torch.matmul(p, q.T, out=m)
            if feedback:
                compressor.errors[matrix.slot].sub_(m, alpha=share)
            compressor.queries[matrix.slot] = q  # a view: it keeps the buffer of Q alone alive
        self._first_buffer = self._q_buffer = None  # type: ignore[assignment]


def compression_ratio(sent: int, uncompressed: int) -> float:
    """How many times fewer bytes went on the wire (``nan`` before anything was compressed)."""
    return uncompressed / sent if sent else math.nan
