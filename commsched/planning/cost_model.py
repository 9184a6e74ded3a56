"""The cost model: from the warm-up's measurements, which partitioning pays on this model and link.

Pure logic, no process group: rank 0 calls `choose` and publishes the result
(`commsched.planning.plans.choose_on_rank0`).

[Note: the cost model] Partitions and the credit window let urgent gradients
overtake large, late ones, which pays when the link is busy enough that the next
forward pass would wait for it. They cost too: buckets are capped at the
partition size, so there are more, smaller collectives, each with its latency
and its host work. Where communication hides behind compute anyway (a fast link,
a small model), that cost is all that is left. So, at the end of warm-up, each
candidate setting (the configured one, coarser partitions, finer ones with a
credit window of one partition, whole buckets, and the bucket sizes torch DDP
users sweep: a fifth and a twenty-fifth of the configured size, where slow links
want more overlap, each also behind the configured first bucket, and for many
hosts, where each collective pays a latency per hop of the ring, whole buckets
without the small first one, and four times the configured size) is replayed on
rank 0's measured timeline: per parameter, when its gradient became ready in the
backward pass; how long the forward pass took; the link's latency and bandwidth,
and how many collectives its transport runs at once (gloo two, taking turns
step by step: [Note: two collectives at once] in `commsched.planning.wire`).
The predicted cost of a candidate is how long the training thread would wait
for communication (at the end of backward without forward overlap; at the
forward pass's layers with it, assuming the forward pass reaches each parameter
in proportion to the bytes before it), plus the host work
of the collectives, plus the computation that communication slows down by
running beside it: its time beside the backward and the next forward pass times
the CPU share of the transport, measured as the process's CPU time per second of
an all-reduce. The host work of a collective is commsched's own
(`COLLECTIVE_HOST_S`) plus its fixed cost (the link's latency) times that share
too: on loopback the fixed cost is the host's own copying and bookkeeping, but
among many hosts on a wire it is mostly the ring's hops, which the waiting
already counts where they delay anything and which cost the host nothing where
they do not. On a GPU cluster that share is small and overlap is nearly free; on
loopback, where the link is the host's own CPU, it is large and overlapping
hides almost nothing. The cheapest wins; a tie goes to fewer collectives.

With sharded optimizer state each bucket's updated parameters are all-gathered
as well, one bucket at a time on gloo ([Note: one all-gather at a time] in
`commsched.update.gather_queue`), so each gathered bucket adds the link's fixed
cost in full, besides the bytes every candidate gathers alike. Without it the
cost model put 1 MiB buckets (six all-gathers) level with 5 MiB ones behind a
1 MiB first bucket (two) on the emulated ResNet-50 at 8 hosts, and the check
measured the former, 10-15% slower.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from commsched.layout.buckets import bucket_layout
from commsched.layout.partitions import make_partitions
from commsched.layout.setting import LayoutSetting
from commsched.layout.shards import gathered_buckets
from commsched.planning.schedule import LinkModel, simulate_schedule
from commsched.strategy import MIB, MIN_BUCKET_MB, MIN_PARTITION_MB, Strategy

COARSER_FACTOR = 4
"""The middle candidate: partitions (and credit) this many times the configured ones."""

FINER_FACTOR = 2
"""The finest candidate: partitions this many times smaller than the configured ones, with a credit
window of one partition, so that the most urgent ready partition always goes next."""

COLLECTIVE_HOST_S = 1e-4
"""The training thread's own work per collective (issuing it, its callbacks, the update it starts):
about a tenth of a millisecond of Python."""

SMALLER_BUCKETS = (5, 25)
"""Whole-bucket candidates this many times smaller than the configured buckets: with torch DDP's
25 MiB, the 5 and 1 MiB its users try."""


@dataclass(frozen=True)
class Timeline:
    """What rank 0 measured during warm-up (medians over the recorded iterations)."""

    slot_ready_s: tuple[float, ...]
    """Per parameter slot: when its gradient was ready, from the start of the backward pass."""
    forward_s: float
    """From the start of the forward pass to the start of the backward pass."""
    link: LinkModel
    """One all-reduce of ``n`` bytes among the replicas, measured idle."""
    transport_cpu_share: float = 0.0
    """CPU time this process spent per second of an all-reduce (its communication
    threads), measured idle, at most 1: the share of communication that competes
    with computation for the host's cores when the two overlap."""


@dataclass(frozen=True)
class Setting:
    """A candidate: the wire unit and the credit window, in MiB (None: whole / unbounded), and for
    whole buckets their size (None: as configured) and the first one's (None: as large as the others)."""

    partition_mb: float | None
    credit_mb: float | None
    bucket_cap_mb: float | None = None
    first_bucket_mb: float | None = None

    def describe(self) -> str:
        if self.partition_mb is None:
            if self.bucket_cap_mb is None:
                return "whole buckets"
            first = "the first too" if self.first_bucket_mb is None else f"the first {self.first_bucket_mb:g} MiB"
            return f"whole buckets of {self.bucket_cap_mb:g} MiB, {first}"
        credit = "no credit window" if self.credit_mb is None else f"credit {self.credit_mb:g} MiB"
        return f"partitions of {self.partition_mb:g} MiB, {credit}"

    def on(self, layout: LayoutSetting) -> LayoutSetting:
        """``layout`` with this candidate's partitioning, and where it has a bucket size, buckets of
        that size: as ``DistributedDataParallel(bucket_cap_mb=...)`` lays them out, the first too
        (one collective fewer than a small first bucket, which is what many hosts pay for) unless
        the candidate keeps a smaller first bucket."""
        changed = layout.with_partitioning(self.partition_mb, self.credit_mb)
        if self.bucket_cap_mb is None:
            return changed
        first = self.bucket_cap_mb if self.first_bucket_mb is None else self.first_bucket_mb
        return dataclasses.replace(changed, bucket_cap_mb=self.bucket_cap_mb, first_bucket_mb=first)

    @classmethod
    def of(cls, layout: LayoutSetting) -> Setting:
        """The candidate ``layout`` is (its buckets' sizes included, as `on` sets them)."""
        if layout.partition_mb is not None:
            return cls(layout.partition_mb, layout.credit_mb)
        first = None if layout.first_bucket_mb == layout.bucket_cap_mb else layout.first_bucket_mb
        return cls(None, None, layout.bucket_cap_mb, first)


@dataclass(frozen=True)
class Prediction:
    setting: Setting
    collectives: int
    wait_s: float
    """Predicted time the training thread waits for communication per iteration."""
    host_s: float
    """Predicted host work of the collectives: `COLLECTIVE_HOST_S` each, and each one's latency
    times the transport's CPU share."""
    contention_s: float = 0.0
    """Predicted slowdown of computation by communication running beside it."""
    gathers: int = 0
    gather_s: float = 0.0
    """Sharded state's all-gathers of the buckets' updated parameters: the fixed cost of each."""

    @property
    def cost_s(self) -> float:
        return self.wait_s + self.host_s + self.contention_s + self.gather_s


@dataclass(frozen=True)
class Choice:
    """The setting chosen, and why (for ``commsched.status``)."""

    setting: Setting
    predictions: tuple[Prediction, ...]
    runner_up: Setting | None = None
    """The cheapest prediction of partitions other than the choice (None: there is none): measured
    beside the choice, since the predictions may rank them wrongly ([Note: confirming the choice]
    in `commsched.tuning.confirmation`). With `best_whole`, the check always weighs partitions
    against whole buckets of a size of their own, whichever the cost model put first."""
    best_whole: Setting | None = None
    """The cheapest prediction of whole buckets of a size of their own (as torch DDP's users tune
    ``bucket_cap_mb``) other than the choice and the runner-up (None: there is none): measured beside
    them too, since the predictions understate most what many collectives cost ([Note: confirming
    the choice])."""

    @property
    def reason(self) -> str:
        if not self.predictions:  # a rank other than 0: it follows rank 0's choice
            return f"rank 0's cost model chose {self.setting.describe()}"
        chosen = next(p for p in self.predictions if p.setting == self.setting)
        others = "; ".join(
            f"{p.setting.describe()}: {p.cost_s * 1e3:.2f} ms ({p.collectives} collectives"
            + (f", {p.gathers} all-gathers)" if p.gathers else ")")
            for p in self.predictions if p.setting != self.setting
        )
        return (
            f"{self.setting.describe()}: predicted {chosen.wait_s * 1e3:.2f} ms waiting for communication "
            f"+ {chosen.host_s * 1e3:.2f} ms for {chosen.collectives} collectives "
            f"+ {chosen.contention_s * 1e3:.2f} ms of computation slowed by it"
            + (f" + {chosen.gather_s * 1e3:.2f} ms for {chosen.gathers} all-gathers" if chosen.gathers else "")
            + " per iteration"
            + (f"; against {others}" if others else "")
        )


T = TypeVar("T")

MAX_CONFIRMATION_MARGIN = 0.03
"""The most a measured setting must be shorter by to replace another (`measured_choice`): medians of
six iterations of one setting differ by a percent or two from run to run on the emulated hosts, and a
smaller gain is not worth a choice that flips between runs. A run's check asks less where its own
trials of one setting agree more closely ([Note: confirming the choice] in `commsched.tuning.confirmation`)."""

MIN_CONFIRMATION_MARGIN = 0.01
"""The least: where repeated trials agree exactly (the simulator's), a gain of a percent still decides,
so that on a quiet cluster the default is not left a few percent behind torch DDP's best bucket size
(at 512-1024 simulated workers, whole 100 MiB buckets 2-3% faster than the configured 25 MiB)."""


def measured_choice(iteration_s: Mapping[T, float], whole: T, margin: float,
                    layout_of: Callable[[T], LayoutSetting] | None = None) -> T:
    """Of settings and their iteration times (``whole``, the configured buckets sent whole, among
    them), the fastest other than ``whole`` if it beats ``whole`` by ``margin`` (a fraction), else
    ``whole``: the rule a run applies to its measurements ([Note: confirming the choice] in
    `commsched.tuning.confirmation`) and ``commsched plan`` to the simulator's. With ``layout_of``
    (a setting's layout), of those within the margin of that fastest and as far ahead of ``whole``,
    the one of fewest collectives (`fewer_collectives_first`): a tie going one way in every run."""
    others = [setting for setting in iteration_s if setting != whole]
    if whole not in iteration_s or not others:
        return whole
    fastest = min(others, key=iteration_s.__getitem__)
    if iteration_s[fastest] >= iteration_s[whole] * (1 - margin):
        return whole
    if layout_of is None:
        return fastest
    level = [s for s in others if iteration_s[s] <= iteration_s[fastest] * (1 + margin)
             and iteration_s[s] < iteration_s[whole] * (1 - margin)]
    return min(level, key=lambda s: fewer_collectives_first(layout_of(s)))


def fewer_collectives_first(layout: LayoutSetting) -> tuple:
    """Whole buckets before partitions, then larger units, then a first bucket as large as the
    others: the order ties between measured settings go in (`measured_choice`)."""
    unit = layout.bucket_cap_mb if layout.partition_mb is None else layout.partition_mb
    return (layout.partition_mb is not None, -unit, -layout.first_bucket_mb, -(layout.credit_mb or math.inf))


def candidates(configured: Setting, bucket_cap_mb: float | None = None, gradient_bytes: int = 0,
               first_bucket_mb: float | None = None, gathers: bool = False) -> list[Setting]:
    """The configured setting, a coarser one, a finer one with a credit of one partition, whole buckets (each
    once); and, where the gradients (``gradient_bytes``) fill more than one bucket of each size, the bucket
    sizes torch DDP users sweep, sent whole, the first as large as the others (as
    ``DistributedDataParallel(bucket_cap_mb=...)`` lays them out): `SMALLER_BUCKETS`, the configured
    ``bucket_cap_mb`` (where the configured first bucket, ``first_bucket_mb``, is smaller), and `COARSER_FACTOR`
    times as large. At many hosts each collective costs a latency per hop of the ring: fewer, larger buckets are
    what DDP users tune for it; where the links are slow, smaller ones overlap more of the backward pass. Each
    smaller size comes twice where the configured first bucket is smaller still: the first as large as the
    others, and the first as configured (the input side's bucket, reduced last and needed first, small).
    No candidate is below the sizes a `Strategy` accepts (`MIN_PARTITION_MB`, `MIN_BUCKET_MB`). With sharded
    optimizer state (``gathers``) none is above ``bucket_cap_mb``: [Note: a bucket's size bounds sharded
    state's memory] in `commsched.update.sharded`."""
    found = [configured]
    if configured.partition_mb is not None:
        credit = None if configured.credit_mb is None else configured.credit_mb * COARSER_FACTOR
        found.append(Setting(configured.partition_mb * COARSER_FACTOR, credit))
        finer = configured.partition_mb / FINER_FACTOR
        if finer >= MIN_PARTITION_MB:
            found.append(Setting(finer, finer))
    found.append(Setting(None, None))
    if bucket_cap_mb is not None:
        for divisor in SMALLER_BUCKETS:
            size = bucket_cap_mb / divisor
            if size >= MIN_BUCKET_MB and gradient_bytes > size * MIB:
                found.append(Setting(None, None, size))
                if first_bucket_mb is not None and first_bucket_mb < size:
                    found.append(Setting(None, None, size, first_bucket_mb))
        if first_bucket_mb is not None and first_bucket_mb < bucket_cap_mb and gradient_bytes > first_bucket_mb * MIB:
            found.append(Setting(None, None, bucket_cap_mb))
        if gradient_bytes > bucket_cap_mb * MIB and not gathers:
            found.append(Setting(None, None, bucket_cap_mb * COARSER_FACTOR))
    unique: list[Setting] = []
    for setting in found:
        if setting not in unique:
            unique.append(setting)
    return unique


def applied(strategy: Strategy, setting: Setting) -> Strategy:
    """``strategy`` with the partitioning of ``setting`` (and its bucket size, where it has one)."""
    return setting.on(LayoutSetting.of(strategy)).applied(strategy)


def predict(
    setting: Setting,
    params: Sequence[torch.Tensor],
    forward_order: Sequence[int],
    layout: LayoutSetting,
    priority: bool,
    timeline: Timeline,
) -> Prediction:
    """Replay one iteration of ``layout`` with the partitioning of ``setting`` on ``timeline``;
    see [Note: the cost model]."""
    candidate = setting.on(layout)
    bucket_slots, priorities = bucket_layout(params, forward_order, candidate.bucket_size_limits_bytes())
    ready = timeline.slot_ready_s
    end_of_backward = max(ready, default=0.0)
    flags_bucket = next(b for b, slots in enumerate(bucket_slots) if forward_order[0] in slots)
    bucket_ready = [
        end_of_backward if b == flags_bucket else max(ready[s] for s in slots) for b, slots in enumerate(bucket_slots)
    ]
    numels = [sum(params[s].numel() for s in slots) for slots in bucket_slots]
    sizes = [params[slots[0]].element_size() for slots in bucket_slots]
    partitions = make_partitions(numels, sizes, priorities, candidate.partition_bytes)
    # Without forward overlap the plan is the order of readiness ([Note: a plan without urgency]).
    by_priority = priority and layout.overlap_forward
    schedule = simulate_schedule(partitions, bucket_ready, timeline.link, candidate.credit_bytes, by_priority)
    bucket_done = [end_of_backward] * len(bucket_slots)
    for p in partitions:
        bucket_done[p.bucket] = max(bucket_done[p.bucket], schedule.finish_s[p.pid])
    if layout.overlap_forward:
        wait = _wait_at_forward(bucket_slots, bucket_done, params, forward_order, end_of_backward, timeline.forward_s)
        computing_until = end_of_backward + wait + timeline.forward_s
    else:
        wait = max(bucket_done) - end_of_backward
        computing_until = end_of_backward
    wait = max(0.0, wait)
    beside_compute = sum(
        _overlap(schedule.start_s[p.pid], schedule.finish_s[p.pid], end_of_backward, wait, computing_until)
        for p in partitions
    )
    cpu_share = min(1.0, max(0.0, timeline.transport_cpu_share))
    host_s = len(partitions) * (COLLECTIVE_HOST_S + timeline.link.latency_s * cpu_share)
    bucket_bytes = [n * size for n, size in zip(numels, sizes, strict=True)]
    gathers = gathered_buckets(bucket_bytes, flags_bucket) if layout.gathers else 0
    return Prediction(setting, len(partitions), wait, host_s, beside_compute * cpu_share, gathers,
                      gathers * timeline.link.latency_s)


def _overlap(start: float, end: float, end_of_backward: float, wait: float, computing_until: float) -> float:
    """How long ``[start, end)`` runs beside computation: the backward pass until
    ``end_of_backward``, then (after ``wait``) the next forward pass until ``computing_until``."""
    during_backward = max(0.0, min(end, end_of_backward) - start)
    resumed = end_of_backward + wait
    during_forward = max(0.0, min(end, computing_until) - max(start, resumed))
    return during_backward + during_forward


def _wait_at_forward(
    bucket_slots: Sequence[Sequence[int]],
    bucket_done: Sequence[float],
    params: Sequence[torch.Tensor],
    forward_order: Sequence[int],
    end_of_backward: float,
    forward_s: float,
) -> float:
    """How long the next forward pass stalls: the latest any bucket arrives after its first use.

    The forward pass is taken to reach each parameter after a share of its
    time equal to the share of parameter bytes used before it.
    """
    total = sum(params[s].numel() * params[s].element_size() for s in forward_order) or 1
    reached_s, seen = {}, 0
    for slot in forward_order:
        reached_s[slot] = end_of_backward + forward_s * seen / total
        seen += params[slot].numel() * params[slot].element_size()
    return max(
        (done - min(reached_s[s] for s in slots) for slots, done in zip(bucket_slots, bucket_done, strict=True)),
        default=0.0,
    )


def choose(
    layout: LayoutSetting,
    priority: bool,
    params: Sequence[torch.Tensor],
    forward_order: Sequence[int],
    timeline: Timeline,
) -> Choice:
    """The cheapest candidate around ``layout``'s partitioning by predicted cost; a tie goes to fewer
    collectives. ``priority``: partitions go most urgent first (`Strategy.priority`)."""
    configured = Setting(layout.partition_mb, layout.credit_mb)
    gradient_bytes = sum(p.numel() * p.element_size() for p in params)
    predictions = tuple(
        predict(setting, params, forward_order, layout, priority, timeline)
        for setting in candidates(configured, layout.bucket_cap_mb, gradient_bytes, layout.first_bucket_mb,
                                  layout.gathers)
    )
    ranked = sorted(predictions, key=lambda p: (round(p.cost_s, 6), p.collectives))
    others = [p.setting for p in ranked[1:] if p.setting.partition_mb is not None]
    runner_up = others[0] if others else None
    sized = [p.setting for p in ranked if p.setting.partition_mb is None and p.setting.bucket_cap_mb is not None
             and p.setting not in (ranked[0].setting, runner_up)]
    return Choice(ranked[0].setting, predictions, runner_up, sized[0] if sized else None)
