"""The event-driven engine: one worker's computation and the shared link(s), iteration after iteration.

See [Note: the simulator] in `commsched.simulator` for the model. A system (a
`Strategy` or torch DDP's `DDPConfig`) is first compiled into buckets, wire
units (partitions, or parameter-server blocks) and a compute program per
iteration (work, bucket ready, wait for a bucket); the engine then runs that
program against the link(s), event by event.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from commsched.layout.buckets import bucket_layout
from commsched.layout.partitions import Partition, make_partitions
from commsched.layout.placement import place_blocks, server_block_bytes
from commsched.planning.calibration import CALIBRATION_BYTES, TWO_STEP_SHARE
from commsched.planning.wire import Flight, Wire, wire_share
from commsched.profiling.profile import Profile
from commsched.simulator.cluster import Cluster
from commsched.simulator.spec import DDPConfig, SimModel, SimResult, model_of
from commsched.strategy import MIB, AllReduce, Strategy


@dataclass(frozen=True, eq=False)
class _System:
    """A system compiled against one model and cluster."""

    name: str
    bucket_ready_s: tuple[float, ...]
    """From the backward pass's start; the held bucket's is ignored (it is ready at the end)."""
    held_bucket: int | None
    """commsched's flags bucket: ready only when the backward pass ends."""
    gate_s: tuple[float, ...]
    """When the forward pass first reads a parameter of the bucket, from its start."""
    update_s: tuple[float, ...]
    """The worker's update of each bucket."""
    unit_bucket: tuple[int, ...]
    unit_bytes: tuple[int, ...]
    unit_key: tuple[tuple, ...]
    """Issue rank among ready units (lower first): priority, or first in first out."""
    unit_resource: tuple[int, ...]
    unit_wire_s: tuple[float, ...]
    unit_after_s: tuple[float, ...]
    """Time from the end of a unit's wire time to its completion (a server's update)."""
    resources: int
    unit_share: tuple[float, ...]
    """How much of its link a unit keeps busy alone: its wire time over its whole time."""
    unit_lane: tuple[int, ...]
    """The connections a unit goes on (`commsched.planning.wire.Flight.lane`): 1 for two all-to-alls."""
    in_flight: int
    """Units a link runs at once (`commsched.planning.wire`): the all-reduce link's; servers' links one."""
    credit_bytes: int | None
    overlap: bool
    update_all_at_once: bool
    """torch DDP: wait for every reduction, then step; commsched: wait and update bucket by bucket."""


def _compile(model: SimModel, cluster: Cluster, system: Strategy | DDPConfig) -> _System:
    if isinstance(system, DDPConfig):
        limits, partition_bytes, by_priority = system.bucket_size_limits_bytes, None, False
        credit, overlap, servers, flags = None, False, 0, False
    elif isinstance(system, Strategy):
        limits, by_priority, credit = system.bucket_size_limits_bytes, system.priority, system.credit_bytes
        overlap, flags = system.overlap_forward, True
        servers = system.backend.num_servers if system.parameter_server else 0
        if servers and cluster.servers != servers:
            raise ValueError(
                f"the strategy has {servers} parameter server(s) but the cluster {cluster.servers}; build the "
                f"cluster with Cluster(..., servers={servers})"
            )
        partition_bytes = server_block_bytes(system.ps_block_bytes, model.total_bytes, servers) if servers \
            else system.partition_bytes
    else:
        raise TypeError(f"simulate takes a commsched Strategy or a DDPConfig, got {type(system).__name__}")

    slots_of, priorities = bucket_layout(model.tensors, model.forward_order, limits)
    bucket_bytes = [sum(model.nbytes[s] for s in slots) for slots in slots_of]
    sizes = [model.tensors[slots[0]].element_size() for slots in slots_of]
    numels = [nbytes // size for nbytes, size in zip(bucket_bytes, sizes, strict=True)]
    units = make_partitions(numels, sizes, priorities, partition_bytes)
    first = model.forward_order[0]
    held = next(b for b, slots in enumerate(slots_of) if first in slots) if flags else None
    total = model.total_bytes or 1
    updates = [0.0 if servers else model.update_s * nbytes / total for nbytes in bucket_bytes]
    two_steps: set[int] = set()
    if servers:
        resource = place_blocks([u.nbytes for u in units], servers)
        wire = [cluster.push_pull_s(u.nbytes) for u in units]
        share = [1.0] * len(units)
        after = [model.update_s * u.nbytes / total for u in units]
    else:
        resource = [0] * len(units)
        two_steps = _in_two_steps(system, cluster, units, held, bucket_bytes)
        cost_of = [cluster.two_step_s if u.pid in two_steps else cluster.allreduce_s for u in units]
        wire = [cost(u.nbytes) for cost, u in zip(cost_of, units, strict=True)]
        share = [wire_share(w, cost(0)) for cost, w in zip(cost_of, wire, strict=True)]
        after = [0.0] * len(units)
    bucket_ready = [max(model.ready_s[s] for s in slots) for slots in slots_of]
    ready_s = [model.backward_end_s if b == held else ready for b, ready in enumerate(bucket_ready)]
    return _System(
        name=system.describe() if isinstance(system, DDPConfig) else _strategy_name(system),
        bucket_ready_s=tuple(bucket_ready),
        held_bucket=held,
        gate_s=tuple(min(model.first_use_s[s] for s in slots) for slots in slots_of),
        update_s=tuple(updates),
        unit_bucket=tuple(u.bucket for u in units),
        unit_bytes=tuple(u.nbytes for u in units),
        unit_key=tuple(_issue_key(u, by_priority, overlap, ready_s) for u in units),
        unit_resource=tuple(resource), unit_wire_s=tuple(wire), unit_after_s=tuple(after),
        unit_share=tuple(share),
        unit_lane=tuple(1 if u.pid in two_steps else 0 for u in units),
        resources=max(1, servers), in_flight=1 if servers else cluster.in_flight, credit_bytes=credit,
        overlap=overlap,
        update_all_at_once=isinstance(system, DDPConfig),
    )


def _issue_key(unit: Partition, by_priority: bool, overlap: bool, bucket_ready_s: list[float]) -> tuple:
    """Which ready unit goes first (lowest): the most urgent with priority and forward overlap; without
    overlap, commsched's plan is the order of readiness ([Note: a plan without urgency] in
    `commsched.planning.schedule`); without priority, bucket order."""
    if by_priority and overlap:
        return (unit.priority, unit.bucket, unit.start)
    if by_priority:
        return (bucket_ready_s[unit.bucket], unit.bucket, unit.start)
    return (unit.bucket, unit.start)


def _in_two_steps(system: Strategy | DDPConfig, cluster: Cluster, units: list[Partition], held: int | None,
                  bucket_bytes: list[int]) -> set[int]:
    """The units all-reduced in two all-to-alls, as a run decides them ([Note: an all-reduce in two
    steps] in `commsched.comm.two_step`): with ``all_to_all_mb="auto"``, the first bucket's where
    that pays behind the largest other bucket (`first_bucket_pays`); with a size, every unit up to it.
    None where the cluster's transport cannot (``Cluster.all_to_all``)."""
    if (not isinstance(system, Strategy) or not isinstance(system.backend, AllReduce) or not cluster.all_to_all
            or cluster.workers < 3 or not system.backend.all_to_all_mb):
        return set()
    size = system.backend.all_to_all_mb
    if size != "auto":
        return {u.pid for u in units if u.nbytes <= float(size) * MIB}
    if held is None:
        return set()
    others = [nbytes for b, nbytes in enumerate(bucket_bytes) if b != held]
    behind = min(max(others, default=bucket_bytes[held]), CALIBRATION_BYTES)
    if not first_bucket_pays(cluster, bucket_bytes[held], behind):
        return set()
    return {u.pid for u in units if u.bucket == held}


def first_bucket_pays(cluster: Cluster, nbytes: int, behind_nbytes: int) -> bool:
    """Whether an all-reduce of ``nbytes`` right behind one of ``behind_nbytes`` is done within
    `TWO_STEP_SHARE` of the ring's time in two all-to-alls, on ``cluster``'s wire: warm-up's test
    (`commsched.planning.calibration.time_both_ways`), simulated."""
    def younger_done_s(two_steps: bool) -> float:
        wire = Wire(cluster.in_flight)
        bulk = cluster.allreduce_s(behind_nbytes)
        wire.add(Flight((0, 0), bulk, wire_share(bulk, cluster.allreduce_s(0))))
        alone = cluster.two_step_s(nbytes) if two_steps else cluster.allreduce_s(nbytes)
        fixed = cluster.two_step_s(0) if two_steps else cluster.allreduce_s(0)
        wire.add(Flight((0, 1), alone, wire_share(alone, fixed), lane=1 if two_steps else 0))
        return wire.finish_times()[(0, 1)]

    return younger_done_s(True) <= TWO_STEP_SHARE * younger_done_s(False)


def _strategy_name(strategy: Strategy) -> str:
    parts = ["priority" if strategy.priority else "FIFO"]
    parts.append("whole buckets" if strategy.partition_mb is None else f"partitions {strategy.partition_mb:g} MiB")
    parts.append("no credit window" if strategy.credit_mb is None else f"credit {strategy.credit_mb:g} MiB")
    parts.append(f"buckets {strategy.bucket_cap_mb:g}/{strategy.first_bucket_mb:g} MiB")
    parts.append("forward overlap" if strategy.overlap_forward else "no overlap")
    if strategy.parameter_server:
        parts.append(f"{strategy.backend.num_servers} parameter server(s)")
    return "commsched (" + ", ".join(parts) + ")"


# ------------------------------------------------------------------ the compute program
_WORK, _READY, _END, _WAIT, _WAIT_ALL, _MARK = range(6)
_FORWARD, _BACKWARD, _UPDATE = range(3)


def _program(model: SimModel, system: _System, iterations: int) -> list[tuple]:
    """Per iteration: its start, the forward pass (with overlap: each bucket of the previous
    iteration waited for and updated where the pass first reads it), the backward pass
    (buckets ready), and without overlap the wait and the update."""
    buckets = range(len(system.bucket_ready_s))
    gates = sorted(buckets, key=lambda b: (system.gate_s[b], b))
    arrivals = sorted((b for b in buckets if b != system.held_bucket), key=lambda b: (system.bucket_ready_s[b], b))
    ops: list[tuple] = []

    def work(seconds: float, phase: int) -> None:
        if seconds > 0:
            ops.append((_WORK, seconds, phase))

    for it in range(iterations):
        ops.append((_MARK, it))
        at = 0.0
        if system.overlap and it > 0:
            for b in gates:
                work(system.gate_s[b] - at, _FORWARD)
                at = max(at, system.gate_s[b])
                ops.append((_WAIT, it - 1, b))
                work(system.update_s[b], _UPDATE)
        work(model.forward_s - at, _FORWARD)
        at = 0.0
        for b in arrivals:
            work(system.bucket_ready_s[b] - at, _BACKWARD)
            at = max(at, system.bucket_ready_s[b])
            ops.append((_READY, it, b))
        work(model.backward_end_s - at, _BACKWARD)
        ops.append((_END, it))
        if not system.overlap:
            if system.update_all_at_once:
                ops.append((_WAIT_ALL, it))
                work(sum(system.update_s), _UPDATE)
            else:
                for b in buckets:
                    ops.append((_WAIT, it, b))
                    work(system.update_s[b], _UPDATE)
    return ops


# ------------------------------------------------------------------ the engine
_WIRE, _DONE = range(2)


class _Run:
    """One simulation: the clock, the wires, and per iteration its dispatcher (ready units, credit)."""

    def __init__(self, system: _System, cluster: Cluster, iterations: int):
        self.s = system
        self.slow = 1.0 + cluster.compute_slowdown
        self.stretch = 1.0 + cluster.collective_slowdown
        self.speed = 1.0 / self.stretch
        """The wires' rate now: slower while the worker computes, full while it waits for them."""
        self.wires = [Wire(system.in_flight) for _ in range(system.resources)]
        self.on_wire: dict[tuple[int, int], tuple[float, float]] = {}
        """Per (iteration, unit) off the wire: when it got its place on the wire and when it left."""
        self.t = 0.0
        self.events: list[tuple] = []
        self.seq = 0
        units_of: list[list[int]] = [[] for _ in system.bucket_ready_s]
        for u, b in enumerate(system.unit_bucket):
            units_of[b].append(u)
        self.units_of = units_of
        self.left = [[len(us) for us in units_of] for _ in range(iterations)]
        self.left_total = [len(system.unit_bucket)] * iterations
        self.ready: list[list[tuple]] = [[] for _ in range(iterations)]
        self.in_flight_bytes = [0] * iterations
        self.in_flight = [0] * iterations
        self.all_ready = [False] * iterations

    # ---------------------------------------------------------- the link
    def _push(self, time: float, kind: int, a: int, b: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (time, self.seq, kind, a, b))

    def _schedule(self, r: int) -> None:
        """Schedule wire ``r``'s next completion as things stand (any earlier one is now stale)."""
        wire = self.wires[r]
        finish = wire.next_finish(self.speed)
        if finish is not None:
            self._push(finish[0], _WIRE, r, wire.version)

    @property
    def active(self) -> bool:
        """A unit is on the wire: computation beside it is stretched."""
        return any(wire.flights for wire in self.wires)

    def pump(self, it: int) -> None:
        """Issue every ready unit of iteration ``it`` the window allows, most urgent first.

        As `commsched.layout.partitions.simulate_schedule`: a unit that does not fit goes
        alone when nothing is in flight, and once every bucket of the pass is ready
        the window no longer limits.
        """
        heap, s = self.ready[it], self.s
        credit = s.credit_bytes
        while heap:
            u = heap[0][-1]
            if (credit is not None and not self.all_ready[it] and self.in_flight[it]
                    and self.in_flight_bytes[it] + s.unit_bytes[u] > credit):
                return
            heapq.heappop(heap)
            r = s.unit_resource[u]
            self.in_flight[it] += 1
            self.in_flight_bytes[it] += s.unit_bytes[u]
            wire = self.wires[r]
            wire.progress(self.t, self.speed)
            wire.add(Flight((it, u), s.unit_wire_s[u], s.unit_share[u], lane=s.unit_lane[u]))
            self._schedule(r)

    def advance(self, until: float) -> None:
        """Handle every event up to ``until`` (the clock must already be there)."""
        events, s = self.events, self.s
        while events and events[0][0] <= until:
            time, _, kind, a, b = heapq.heappop(events)
            if kind == _WIRE:
                wire = self.wires[a]
                if b != wire.version:
                    continue  # the wire changed since: a later event stands for it
                wire.progress(time, self.speed)
                finish = wire.next_finish(self.speed)
                assert finish is not None, "a wire completion with nothing on the wire (a bug in the engine)"
                flight = wire.finish(finish[1])
                self.on_wire[flight.key] = (flight.since_s, time)
                self._schedule(a)
                it, u = flight.key
                if s.unit_after_s[u] > 0:
                    self._push(time + s.unit_after_s[u], _DONE, it, u)
                    continue
            else:
                it, u = a, b
            self.in_flight[it] -= 1
            self.in_flight_bytes[it] -= s.unit_bytes[u]
            self.left[it][s.unit_bucket[u]] -= 1
            self.left_total[it] -= 1
            if self.ready[it]:
                self.pump(it)

    def link_busy_s(self, it: int) -> float:
        """The busiest resource's time with one of iteration ``it``'s units on the wire."""
        spans: list[list[tuple[float, float]]] = [[] for _ in self.wires]
        for (of, u), span in self.on_wire.items():
            if of == it:
                spans[self.s.unit_resource[u]].append(span)
        busy = []
        for intervals in spans:
            total, reached = 0.0, -math.inf
            for start, end in sorted(intervals):
                if end > reached:
                    total += end - max(start, reached)
                    reached = end
            busy.append(total)
        return max(busy)

    def mark_ready(self, it: int, bucket: int) -> None:
        keys, ready = self.s.unit_key, self.ready[it]
        for u in self.units_of[bucket]:
            heapq.heappush(ready, (keys[u], u))

    # ---------------------------------------------------------- the worker
    def compute(self, seconds: float) -> float:
        """Run ``seconds`` of computation, slower while a unit is on the wire; returns the time it took."""
        began, events, remaining = self.t, self.events, seconds
        while remaining > 0:
            factor = self.slow if self.active else 1.0
            finish = self.t + remaining * factor
            if events and events[0][0] < finish:
                at = events[0][0]
                if at > self.t:
                    remaining -= (at - self.t) / factor
                    self.t = at
                self.advance(self.t)
            else:
                self.t = finish
                remaining = 0.0
        return self.t - began

    def wait_until(self, done) -> float:
        """Let the link run until ``done()``; returns the time waited."""
        began = self.t
        if done():
            return 0.0
        self._set_computing(False)
        while not done():
            if not self.events:
                raise RuntimeError("the simulation waits for a unit that was never issued (a bug in the engine)")
            self.t = max(self.t, self.events[0][0])
            self.advance(self.t)
        self._set_computing(True)
        return self.t - began

    def drain(self, it: int) -> None:
        """Run the wires, at their rate now, until every unit of iteration ``it`` is off them (after the
        last iteration: what it left on the wire counts in its link time)."""
        while self.left_total[it] and self.events:
            self.t = max(self.t, self.events[0][0])
            self.advance(self.t)

    def _set_computing(self, computing: bool) -> None:
        """The worker starts or stops computing at ``t``: the wires' rate changes from then on."""
        speed = 1.0 / self.stretch if computing else 1.0
        if speed == self.speed:
            return
        self.advance(self.t)
        for wire in self.wires:
            wire.progress(self.t, self.speed)
            wire.version += 1
        self.speed = speed
        for r in range(len(self.wires)):
            self._schedule(r)


def simulate(profile: Profile, cluster: Cluster, system: Strategy | DDPConfig, iterations: int = 4) -> SimResult:
    """``iterations`` consecutive iterations of ``system`` sharing the link(s); the last one reported.

    The first iteration starts on an idle link with nothing to wait for; the
    next ones wait for what the one before left (the forward pass's gates), so
    from the second on they repeat: the last is the steady state. A `Strategy`
    is taken literally (``adaptive`` is not applied: the simulator is what
    chooses).
    """
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be an integer >= 1, got {iterations!r} (2 or more reach steady state)")
    model = model_of(profile)
    compiled = _compile(model, cluster, system)
    run = _Run(compiled, cluster, iterations)
    current, started = 0, 0.0
    phases = [0.0, 0.0, 0.0]
    plain = 0.0
    for op in _program(model, compiled, iterations):
        code = op[0]
        if code == _WORK:
            phases[op[2]] += run.compute(op[1])
            plain += op[1]
        elif code == _READY:
            it = op[1]
            run.mark_ready(it, op[2])
            run.advance(run.t)
            run.pump(it)
        elif code == _END:
            it = op[1]
            if compiled.held_bucket is not None:
                run.mark_ready(it, compiled.held_bucket)
            run.all_ready[it] = True
            run.advance(run.t)
            run.pump(it)
        elif code == _WAIT:
            left, b = run.left[op[1]], op[2]
            run.wait_until(lambda: left[b] == 0)
        elif code == _WAIT_ALL:
            left_total, it = run.left_total, op[1]
            run.wait_until(lambda: left_total[it] == 0)
        else:  # _MARK
            current, started = op[1], run.t
            phases = [0.0, 0.0, 0.0]
            plain = 0.0
    iteration_s = run.t - started
    compute_s = sum(phases)
    run.drain(current)
    return SimResult(
        iteration_s=iteration_s, compute_s=compute_s, link_busy_s=run.link_busy_s(current),
        exposed_s=max(0.0, iteration_s - compute_s), collectives=len(compiled.unit_bucket),
        forward_s=phases[_FORWARD], backward_s=phases[_BACKWARD], update_s=phases[_UPDATE],
        contention_s=max(0.0, compute_s - plain), system=compiled.name,
    )


def bound_s(profile: Profile, cluster: Cluster) -> float:
    """The bench's bound: max(computation alone, the link time every gradient needs).

    All-reduce: one all-reduce of every gradient. No system is faster where the
    link runs one collective at a time (``cluster.in_flight`` 1); where it runs
    two, as gloo does, smaller collectives at once can be, each sending while
    the other waits for a hop ([Note: two collectives at once]). With ``cluster.servers``: as
    `commsched.bench.grid` defines it, the busiest server link, each worker's
    copy of that server's bytes in and out at the link rate (taken perfectly
    balanced), against the worker's computation without the update (the
    servers run it).
    """
    model = model_of(profile)
    compute = model.forward_s + model.backward_end_s
    if cluster.servers:
        link = cluster.workers * math.ceil(model.total_bytes / cluster.servers) / cluster.bytes_per_s
        return max(compute, link)
    return max(compute + model.update_s, cluster.allreduce_s(model.total_bytes))


def sharded_bound_s(profile: Profile, cluster: Cluster, reduce_scatter: bool) -> float:
    """The bound of sharded optimizer state (``AllReduce(shard_optimizer=True)``, ZeRO-1; with
    ``reduce_scatter``, ZeRO-2), on an all-reduce link: `bound_s`, and what sharding adds to it.

    [Note: the bound of sharded state] A rank updates its chunk of a bucket at ``step()``, after
    the backward pass, so the other ranks' new values reach it only then: (N - 1) / N of every
    parameter's bytes on each link, between the end of one backward pass and the first use of
    the last parameter in the next forward pass. A bucket kept whole instead is all-reduced,
    twice those bytes, and it too starts only when its last gradient is ready. So an iteration
    takes at least the backward pass, then that gather at the link rate (or the forward pass up
    to that first use, if longer), then the rest of the forward pass. Where the gather outlasts
    the forward pass (the emulated ResNet-50 on 8 hosts at 0.5 Gbit/s: 107 against 69 ms), this
    is above the all-reduce backend's bound, for any schedule: the parameters' new values cannot
    be sent before they exist. ZeRO-1 also all-reduces every gradient, so its link carries
    3 (N - 1) / N of the parameters' bytes per iteration, against an all-reduce's 2 (N - 1) / N.
    """
    bound = bound_s(profile, cluster)
    n = cluster.workers
    if n == 1 or cluster.servers:
        return bound
    model = model_of(profile)
    gathered_s = (n - 1) * cluster.latency_s + (n - 1) / n * model.total_bytes / cluster.bytes_per_s
    last_use_s = max(model.first_use_s, default=0.0)
    after_backward = model.backward_end_s + max(last_use_s, gathered_s) + model.forward_s - last_use_s
    bound = max(bound, after_backward)
    if not reduce_scatter:
        bound = max(bound, 3 * (n - 1) / n * model.total_bytes / cluster.bytes_per_s)
    return bound
