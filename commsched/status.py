"""`commsched.status(model)`: what commsched decided for a prepared model, and why.

A snapshot (plain frozen dataclasses) of the layout, the lifecycle, whether
forward overlap is on and why not, and the figures of the latest iterations.
Reading it has no side effect.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from commsched.engine.backward_pass import IterationFigures
from commsched.engine.groups import ProcessGroups
from commsched.engine.lifecycle import Lifecycle
from commsched.engine.reducer import GradientReducer
from commsched.layout.setting import LayoutSetting
from commsched.layout.shards import ShardStatus
from commsched.tuning import confirmation
from commsched.tuning.decision import Phase
from commsched.tuning.log import TuningLog


@dataclass(frozen=True)
class BucketStatus:
    index: int
    """Buckets are numbered in the order their gradients are produced."""
    parameters: tuple[str, ...]
    nbytes: int
    dtype: str
    priority: int
    """The forward position of its earliest parameter (lower is more urgent)."""
    partitions: int
    reduce_dtype: str = ""
    """The dtype it is summed in across ranks: its own, or `commsched.Strategy.reduce_dtype`'s."""
    wire_nbytes: int = 0
    """Bytes it puts on the wire per all-reduce (``nbytes`` unless summed in another dtype)."""
    partition_nbytes: tuple[int, ...] = ()
    """Each of its partitions' bytes on the wire, in order."""
    averaged: tuple[int, int] | None = None
    """Where it is reduce-scattered: the elements of its gradients that hold the average on this
    rank once reduced (None: all-reduced, every element)."""
    offsets: tuple[int, ...] = ()
    """Where each of ``parameters``' gradients starts among the bucket's elements, in the same order
    (the elements `averaged` counts)."""


@dataclass(frozen=True)
class CompressionStatus:
    """With ``Strategy(compression=PowerSGD(...))``: what went compressed, and the bytes it saved."""

    settings: str
    """The `commsched.PowerSGD` in use, as it would be written."""
    active: bool
    """Whether buckets go compressed now (from ``start_powerSGD_iter`` on)."""
    compressed_parameters: tuple[str, ...]
    """The parameters whose gradients go as ``P`` and ``Q`` (the others go whole, with the ``P``)."""
    bytes_sent: int
    """Bytes this rank put on the wire for compressed buckets so far."""
    bytes_uncompressed: int
    """What the same buckets would have put on the wire uncompressed."""

    @property
    def ratio(self) -> float:
        """How many times fewer bytes went on the wire (nan before anything was compressed)."""
        return self.bytes_uncompressed / self.bytes_sent if self.bytes_sent else float("nan")


@dataclass(frozen=True)
class TrialStatus:
    setting: LayoutSetting
    median_ms: float
    """Median iteration time measured with it (inf: nothing was measured)."""


@dataclass(frozen=True)
class TuningStatus:
    """``Strategy(autotune=True)``: what was tried, what is in use and why (the same on every rank)."""

    phase: str
    """``"warm-up"`` (not started), ``"tuning"``, ``"tuned"``, ``"re-tuning"`` or ``"stopped"``."""
    reason: str
    """E.g. ``"tuning: trial 5 of ~12"``, ``"tuned: ..."``, ``"re-tuning: iteration time rose 35%; ..."``."""
    trials: tuple[TrialStatus, ...]
    """The trials of the latest search, in the order they ran."""
    searches: int
    """Searches so far (1, plus one per re-tune)."""
    current: LayoutSetting | None
    best: LayoutSetting | None
    """The fastest setting measured in the latest search."""
    changes: tuple[tuple[int, LayoutSetting], ...]
    """Every setting taken into use, with the iteration it took effect at."""
    baseline_ms: float | None
    """Once tuned: the median iteration time drift is measured against."""

    def describe(self) -> str:
        lines = [f"  auto-tuning: {self.reason}"]
        for number, trial in enumerate(self.trials, 1):
            lines.append(f"    trial {number}: {trial.setting.describe()}: {trial.median_ms:.2f} ms")
        return "\n".join(lines)


@dataclass(frozen=True)
class Status:
    lifecycle: Lifecycle
    iterations: int
    """Synchronised backward passes begun so far."""
    overlap_off_reason: str | None
    """Why forward overlap is off (None: it is on, or will be after warm-up)."""
    plan: str
    """Which issue order the partitions follow."""
    transport: str
    buckets: tuple[BucketStatus, ...]
    flags_bucket: int | None
    """The bucket carrying the used-parameter flags: the one the forward pass needs first."""
    partitions: int
    server_bytes: tuple[int, ...]
    """With parameter servers: bytes of blocks each server holds."""
    current_iteration: IterationFigures | None
    """The latest synchronised iteration so far (waits still to come in gates are not in it yet)."""
    previous_iteration: IterationFigures | None
    """The one before it, complete."""
    updated_at_step: tuple[int, ...] = ()
    """With forward overlap: buckets updated at ``step()`` because the training loop
    reads their parameters before the next forward pass (seen during warm-up)."""
    updated_after_forward: tuple[int, ...] = ()
    """Buckets updated when the forward pass returns, because the loop reads them after it."""
    gated_at_forward_start: tuple[str, ...] = ()
    """Parameters a warm-up forward pass read before the modules that wait for them ran (its
    control flow differed from the first pass's): the forward pass waits for them at its start."""
    partition_mb: float | None = None
    """The partition size in use (None: whole buckets)."""
    credit_mb: float | None = None
    """The credit window in use (None: unbounded)."""
    partitioning: str = ""
    """Why this partitioning: as configured, or the cost model's choice at the end of
    warm-up with its predictions (on rank 0; the other ranks follow it)."""
    tuning: TuningStatus | None = None
    """With ``Strategy(autotune=True)``: the auto-tuner's trials and decisions (None: off)."""
    bucket_cap_mb: float | None = None
    """The bucket size limit in use."""
    first_bucket_mb: float | None = None
    """The first bucket's size limit in use."""
    sharding: ShardStatus | None = None
    """With ``AllReduce(shard_optimizer=True)``: what each rank owns and this rank's bytes of
    optimizer state (None: unsharded)."""
    reduce_scatter_off_reason: str | None = None
    """With ``AllReduce(shard_optimizer=True, reduce_scatter=True)``: why gradients stay all-reduced
    whole (warm-up saw the loop need them whole); None where they are reduce-scattered, or will be
    after warm-up, or where the strategy does not ask for it."""
    compression: CompressionStatus | None = None
    """With ``Strategy(compression=...)``: what goes compressed and the bytes saved (None: off)."""
    two_step_max_bytes: int | None = None
    """Partitions of at most this many bytes are all-reduced in two all-to-alls (0: none, after
    the timing at the end of warm-up found the ring faster); None where two steps never apply."""
    compiled_pieces: tuple[int, ...] = ()
    """With forward overlap, per graph of the model's compiled regions compiled so far, how many pieces
    it was cut into, each waiting for its own buckets ([Note: gates in compiled graphs])."""
    process_groups: ProcessGroups | None = None
    """The groups the model communicates on (replicas, buffer broadcasts, control messages); None
    once released. The buffer and control groups are commsched's side groups where it needs them."""

    @property
    def overlapping(self) -> bool:
        """Forward overlap is on: ``step()`` returns at once, modules wait at their gates."""
        return self.lifecycle is Lifecycle.OVERLAPPING

    def describe(self) -> str:
        """A few lines for a log."""
        overlap = "on" if self.overlapping else f"off ({self.overlap_off_reason or 'until warm-up ends'})"
        lines = [
            f"commsched: {self.lifecycle.value}, {self.iterations} iterations, {self.transport}",
            f"  {len(self.buckets)} buckets, {self.partitions} partitions, "
            f"{sum(b.nbytes for b in self.buckets) / 2**20:.2f} MiB; plan: {self.plan}",
            f"  forward overlap: {overlap}",
            f"  partitioning: {self.partitioning}",
        ]
        reduction = _reduction(self.buckets)
        if reduction:
            lines.append(f"  reduction: {reduction}")
        if self.sharding is not None:
            lines.append(f"  {self.sharding.describe()}")
        if self.reduce_scatter_off_reason is not None:
            lines.append(f"  reduce-scatter: off ({self.reduce_scatter_off_reason})")
        if self.tuning is not None:
            lines.append(self.tuning.describe())
        if self.updated_at_step or self.updated_after_forward:
            lines.append(
                f"  read outside the forward pass: {len(self.updated_at_step)} buckets updated at step(), "
                f"{len(self.updated_after_forward)} when the forward pass returns"
            )
        if self.compiled_pieces:
            lines.append(f"  compiled: {len(self.compiled_pieces)} graphs in {sum(self.compiled_pieces)} pieces, "
                         "each waiting for its own buckets")
        if self.gated_at_forward_start:
            names = ", ".join(self.gated_at_forward_start[:3])
            more = len(self.gated_at_forward_start) - 3
            lines.append(
                "  waited for at the forward start (read before their modules in warm-up): "
                + names + (f" and {more} more" if more > 0 else "")
            )
        for label, figures in (("previous", self.previous_iteration), ("current", self.current_iteration)):
            if figures is not None:
                lines.append(
                    f"  {label} iteration {figures.iteration}: {figures.partitions_issued} partitions, "
                    f"{figures.bytes_issued / 2**20:.2f} MiB issued, waited {figures.exposed_wait_s * 1e3:.1f} ms "
                    f"for reductions, updates {figures.update_s * 1e3:.1f} ms"
                    + ("" if figures.host_waits is None else f", {figures.host_waits} host waits on the device")
                )
        return "\n".join(lines)


def reducer_status(reducer: GradientReducer) -> Status:
    layout, plan, current = reducer.layout, reducer.plan, reducer.current
    buckets: tuple[BucketStatus, ...] = ()
    if layout is not None:
        counts = [0] * len(layout.buckets)
        sizes: list[list[int]] = [[] for _ in layout.buckets]
        for partition in layout.partitions:
            counts[partition.bucket] += 1
            sizes[partition.bucket].append(partition.nbytes)
        scatter = reducer.transport.scatter
        buckets = tuple(
            BucketStatus(b.index, tuple(layout.names[s] for s in slots), b.nbytes, _dtype_name(b.dtype),
                         priority, count, _dtype_name(b.wire_dtype), b.wire_nbytes, tuple(nbytes),
                         None if scatter is None or b.index not in scatter.scattered else scatter.averaged_range(b),
                         tuple(b.offsets))
            for b, slots, priority, count, nbytes in zip(layout.buckets, layout.bucket_slots, layout.priorities,
                                                         counts, sizes, strict=True)
        )
    if plan is None:
        plan_text = "none yet (the first forward pass records the order)"
    elif plan.agreed and plan.by_readiness:
        plan_text = ("rank 0's plan, agreed after warm-up (buckets in the order they became ready on its "
                     "timeline, credit window: without forward overlap nothing needs one bucket first)")
    elif plan.agreed:
        plan_text = "rank 0's plan, agreed after warm-up (forward order first, credit window)"
    else:
        plan_text = "buckets in the order their gradients are ready (torch DDP's)"
    transport = reducer.transport.describe()
    gating, layout_in_use, groups = reducer.gating, reducer.config.layout, reducer.groups
    return Status(
        lifecycle=reducer.lifecycle,
        iterations=0 if current is None else current.iteration + 1,
        overlap_off_reason=reducer.overlap_off_reason,
        reduce_scatter_off_reason=reducer.reduce_scatter_off_reason,
        plan=plan_text,
        transport=transport.description,
        buckets=buckets,
        flags_bucket=None if layout is None else layout.flags_bucket,
        partitions=0 if layout is None else len(layout.partitions),
        server_bytes=transport.server_bytes,
        current_iteration=None if current is None else replace(current.figures),
        previous_iteration=None if reducer.previous_figures is None else replace(reducer.previous_figures),
        updated_at_step=gating.updated_at_step,
        updated_after_forward=gating.updated_after_forward,
        gated_at_forward_start=gating.gated_at_forward_start,
        partition_mb=layout_in_use.partition_mb,
        credit_mb=layout_in_use.credit_mb,
        partitioning=_partitioning(reducer),
        tuning=_tuning(reducer),
        bucket_cap_mb=layout_in_use.bucket_cap_mb,
        first_bucket_mb=layout_in_use.first_bucket_mb,
        sharding=None if reducer.policy.sharded is None else reducer.policy.sharded.status(),
        two_step_max_bytes=transport.two_step_max_bytes,
        compression=_compression(reducer),
        compiled_pieces=reducer.compiled_pieces,
        process_groups=None if groups.replicas is None else replace(groups),
    )


def _compression(reducer: GradientReducer) -> CompressionStatus | None:
    compressor, layout = reducer.transport.compression, reducer.layout
    if compressor is None:
        return None
    slots = compressor.compressed_slots()
    names = () if layout is None else tuple(layout.names[s] for s in sorted(slots))
    return CompressionStatus(repr(compressor.settings), compressor.active, names, compressor.bytes_sent,
                             compressor.bytes_uncompressed)


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def _reduction(buckets: tuple[BucketStatus, ...]) -> str:
    """Which gradients are summed in another dtype than their own, and the bytes on the wire."""
    changed: dict[tuple[str, str], list[BucketStatus]] = {}
    for bucket in buckets:
        if bucket.reduce_dtype and bucket.reduce_dtype != bucket.dtype:
            changed.setdefault((bucket.dtype, bucket.reduce_dtype), []).append(bucket)
    parts = []
    for (dtype, reduce_dtype), group in changed.items():
        ratio = sum(b.wire_nbytes for b in group) / sum(b.nbytes for b in group)
        buckets = f"{len(group)} bucket{'s' if len(group) > 1 else ''}"
        parts.append(f"{dtype} gradients summed in {reduce_dtype} ({buckets}, {ratio:g}x their bytes on the wire)")
    return "; ".join(parts)


_PHASES = {Phase.TUNING: "tuning", Phase.TUNED: "tuned", Phase.RETUNING: "re-tuning", Phase.STOPPED: "stopped"}


def _tuning(reducer: GradientReducer) -> TuningStatus | None:
    if reducer.config.tuning is None:
        return None
    tuning = reducer.layouts.tuning
    log = TuningLog() if tuning is None else tuning.log
    if log.current is None:
        return TuningStatus("warm-up", "tuning starts when warm-up ends", (), 0, None, None, (), None)
    trials = tuple(TrialStatus(t.setting, t.median_s * 1e3) for t in (log.studies[-1] if log.studies else ()))
    best = log.best
    return TuningStatus(
        phase=_PHASES[log.phase], reason=log.describe(), trials=trials, searches=len(log.studies),
        current=log.current, best=None if best is None else best.setting, changes=tuple(log.settings),
        baseline_ms=log.baseline_ms,
    )


def _partitioning(reducer: GradientReducer) -> str:
    layouts = reducer.layouts
    tuning, choice = layouts.tuning, layouts.choice
    if layouts.confirming is not None and tuning is not None:
        measured = confirmation.describe(tuning.log, *layouts.confirming)
        if choice is not None and choice.predictions:
            return f"{measured}; its prediction: {choice.reason}"
        return measured
    if tuning is not None and tuning.log.current is not None:
        return "the auto-tuner's setting in use (see auto-tuning)"
    if choice is None:
        if reducer.config.adaptive and reducer.lifecycle is not Lifecycle.RELEASED:
            return "as configured until warm-up ends; then the cost model's choice"
        return "as configured (Strategy.adaptive is off or does not apply)"
    if choice.predictions:
        return f"the cost model's choice: {choice.reason}"
    return choice.reason
