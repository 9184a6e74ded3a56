"""Is a reduce-scatter cheaper than an all-reduce on gloo? Timed on emulated hosts (root) or loopback.

    sudo .venv/bin/python benchmarks/collectives.py --json results/collectives.json   # about 2 minutes on 2 cores

In a ring, a reduce-scatter moves half the bytes of an all-reduce ((N-1)/N of
the tensor per rank, against 2(N-1)/N), so ZeRO-2 (reduce-scatter of
gradients, all-gather of parameters) would cost the wire no more than an
all-reduce alone. Whether gloo's implementations get there decides between
that and ZeRO-1 (all-reduce, then all-gather: `commsched.update.sharded`).

Per number of hosts and link rate, a fresh `EmulatedCluster` (the one
``commsched bench`` uses; one process per host, gloo on the host's ``eth0``)
times, on float32 tensors of each size: ``all_reduce``; ``reduce_scatter_single``
(``reduce_scatter_tensor`` before torch 2.13) into a 1/N chunk; ``reduce_scatter``
of the tensor's N chunks as a list (left out where gloo refuses it); two
reduce-scatters built from other collectives, to see what gloo's transport can
do: ``all_to_all_single`` of the N chunks followed by a local sum, and a ring of
``isend``/``irecv`` (N-1 steps, each passing one accumulated chunk to the next
rank); and ``all_gather_single`` (``all_gather_into_tensor``) of a 1/N chunk into
the tensor, and the same built from ``all_to_all_single`` (each rank sends N copies of
its chunk, one to every rank, all at once). All concern the same bytes. Without root (or with ``--loopback``) the
ranks run on this machine's loopback instead, unshaped.

Every round runs every size, and per size the collectives take turns (the
order rotated each round); each one starts after a barrier and its time is the
slowest rank's. The first round is not measured. Reported: the median over
rounds of each collective's time, and the medians of the per-round ratios
reduce_scatter / all_reduce and (reduce_scatter + all_gather) / (all_reduce +
all_gather), for both forms of reduce-scatter; *wire ms* is what a ring
all-reduce of the tensor takes at the link's rate, for scale.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_reduce_a2a", "reduce_scatter", "reduce_scatter_list", "reduce_scatter_a2a", "reduce_scatter_ring",
       "all_gather", "all_gather_a2a")
REDUCE_SCATTERS = ("reduce_scatter", "reduce_scatter_list", "reduce_scatter_a2a", "reduce_scatter_ring")
MIB = 2**20

reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""torch's reduce-scatter of one tensor into equal chunks (``reduce_scatter_tensor`` before 2.13)."""
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""torch's gather of equal chunks into one tensor (``all_gather_into_tensor`` before 2.13)."""


def _collectives(elements: int, world_size: int) -> dict[str, Callable[[], object]]:
    """The timed collectives on preallocated tensors of ``elements`` float32 (a multiple of the world size)."""
    full, chunk = torch.ones(elements), torch.ones(elements // world_size)
    pieces = list(full.chunk(world_size))
    exchanged, passed_on = torch.empty(elements), torch.empty(elements // world_size)

    def reduce_scatter_a2a() -> None:
        """Each rank receives every rank's copy of its chunk, then sums them."""
        dist.all_to_all_single(exchanged, full)
        torch.sum(exchanged.view(world_size, -1), dim=0, out=chunk)

    def reduce_scatter_ring() -> None:
        """In step s, rank r sends its running sum of chunk r-s-1 to rank r+1 and adds what rank r-1
        sends (chunk r-s-2) to its own; after N-1 steps chunk r is summed on rank r."""
        rank = dist.get_rank()
        running = exchanged.copy_(full).view(world_size, -1)
        for step in range(world_size - 1):
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, running[(rank - step - 1) % world_size], (rank + 1) % world_size),
                dist.P2POp(dist.irecv, passed_on, (rank - 1) % world_size)])
            for work in works:
                work.wait()
            running[(rank - step - 2) % world_size] += passed_on
        chunk.copy_(running[rank])

    def all_gather_a2a() -> None:
        """Each rank sends its chunk to every rank at once (an all-to-all of N copies of it)."""
        exchanged.view(world_size, -1).copy_(chunk.expand(world_size, -1))
        dist.all_to_all_single(full, exchanged)

    def all_reduce_a2a() -> None:
        """A reduce-scatter by all-to-all, then an all-gather by all-to-all: 2 steps, not 2(N-1)."""
        reduce_scatter_a2a()
        all_gather_a2a()

    return {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_reduce_a2a": all_reduce_a2a,
        "reduce_scatter": lambda: reduce_scatter_single(chunk, full),
        "reduce_scatter_list": lambda: dist.reduce_scatter(chunk, pieces),
        "reduce_scatter_a2a": reduce_scatter_a2a,
        "reduce_scatter_ring": reduce_scatter_ring,
        "all_gather": lambda: all_gather_single(full, chunk),
        "all_gather_a2a": all_gather_a2a,
    }


def time_on_rank(rank: int, world_size: int, sizes_mib: list[float], rounds: int) -> dict | None:
    """Every round's time of each collective and size, seconds (the slowest rank's); rank 0 returns
    ``{"size_mib": {op: [seconds per round]}}``, the others None. Needs an initialised gloo group.

    A collective this torch's gloo refuses (the list form of reduce-scatter, in older torch) is left out:
    it refuses on every rank alike, before sending anything."""
    torch.set_num_threads(1)
    ops = {size: _collectives(int(size * MIB / 4) // world_size * world_size, world_size) for size in sizes_mib}
    names = list(OPS)
    samples: list[tuple[float, str, float]] = []
    for round_index in range(rounds + 1):  # round 0: connections and first touch, not measured
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for size in sizes_mib:
            for op in order:
                dist.barrier()
                start = time.perf_counter()
                try:
                    ops[size][op]()
                except RuntimeError:
                    if round_index:
                        raise
                    names.remove(op)
                    continue
                if round_index:
                    samples.append((size, op, time.perf_counter() - start))
    slowest = torch.tensor([seconds for _, _, seconds in samples], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank != 0:
        return None
    times: dict = {str(size): {op: [] for op in names} for size in sizes_mib}
    for (size, op, _), seconds in zip(samples, slowest.tolist(), strict=True):
        times[str(size)][op].append(seconds)
    return times


# ------------------------------------------------------------------ where the ranks run
def worker(config_path: Path, out_path: Path) -> None:
    """One emulated host, started in its namespace with torch's env:// variables."""
    spec = json.loads(config_path.read_text())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec["timeout_s"]))
    times = time_on_rank(dist.get_rank(), dist.get_world_size(), spec["sizes_mib"], spec["rounds"])
    if times is not None:
        out_path.write_text(json.dumps(times))
    dist.destroy_process_group()


def on_cluster(hosts: int, rate_gbit: float, sizes_mib: list[float], rounds: int, timeout_s: float) -> dict:
    """`time_on_rank` on a fresh cluster of ``hosts`` with links of ``rate_gbit``."""
    from commsched.bench.cluster import LinkSpec, run_script_on_hosts

    return run_script_on_hosts(__file__, hosts, LinkSpec(rate_mbit=rate_gbit * 1000),
                               {"sizes_mib": sizes_mib, "rounds": rounds, "timeout_s": timeout_s}, timeout_s,
                               f"the collectives on {hosts} hosts at {rate_gbit:g} Gbit/s")


def on_loopback(hosts: int, sizes_mib: list[float], rounds: int, timeout_s: float) -> dict:
    from commsched.testing import run_ranks

    return run_ranks(time_on_rank, hosts, sizes_mib, rounds, timeout_s=timeout_s, collective_timeout_s=timeout_s)[0]


# ------------------------------------------------------------------ report
def wire_ms(size_mib: float, hosts: int, rate_gbit: float | None) -> float | None:
    """A ring all-reduce's bytes per rank, 2(N-1)/N of the tensor, at the link's rate."""
    if rate_gbit is None:
        return None
    return 2 * (hosts - 1) / hosts * size_mib * MIB * 8 / (rate_gbit * 1e9) * 1e3


def _ratio(numerators: list[list[float]], denominators: list[list[float]]) -> float:
    """The median over rounds of sum(numerators) / sum(denominators), each round's own."""
    return statistics.median(sum(n) / sum(d) for n, d in zip(zip(*numerators), zip(*denominators), strict=True))


def rows(hosts: int, rate_gbit: float | None, times: dict) -> list[dict]:
    """One row per size: median ms per collective and the medians of the per-round ratios."""
    out = []
    for size, by_op in times.items():
        ar, ag = by_op["all_reduce"], by_op["all_gather"]
        row = {"hosts": hosts, "link": "loopback" if rate_gbit is None else f"{rate_gbit:g} Gbit/s",
               "size_mib": float(size), "wire_ms": wire_ms(float(size), hosts, rate_gbit),
               **{f"{op}_ms": statistics.median(seconds) * 1e3 for op, seconds in by_op.items()}}
        for op in REDUCE_SCATTERS:
            if op in by_op:
                row[f"{op}/all_reduce"] = _ratio([by_op[op]], [ar])
                row[f"({op}+all_gather)/(all_reduce+all_gather)"] = _ratio([by_op[op], ag], [ar, ag])
        out.append(row)
    return out


COLUMNS = {
    "hosts": "hosts", "link": "link", "size_mib": "MiB", "wire_ms": "wire ms", "all_reduce_ms": "AR ms",
    "reduce_scatter_ms": "RS ms", "reduce_scatter_list_ms": "RS list ms", "all_gather_ms": "AG ms",
    "reduce_scatter/all_reduce": "RS / AR", "(reduce_scatter+all_gather)/(all_reduce+all_gather)": "(RS+AG) / (AR+AG)",
    "reduce_scatter_list/all_reduce": "RS list / AR",
    "(reduce_scatter_list+all_gather)/(all_reduce+all_gather)": "(RS list+AG) / (AR+AG)",
    "reduce_scatter_a2a_ms": "RS a2a ms", "reduce_scatter_a2a/all_reduce": "RS a2a / AR",
    "(reduce_scatter_a2a+all_gather)/(all_reduce+all_gather)": "(RS a2a+AG) / (AR+AG)",
    "reduce_scatter_ring_ms": "RS p2p ring ms", "reduce_scatter_ring/all_reduce": "RS p2p ring / AR",
    "(reduce_scatter_ring+all_gather)/(all_reduce+all_gather)": "(RS p2p ring+AG) / (AR+AG)",
    "all_gather_a2a_ms": "AG a2a ms", "all_reduce_a2a_ms": "AR a2a ms",
}
"""Row key: column heading (AR all_reduce, RS reduce_scatter_single, RS list: reduce_scatter of a list
of chunks, RS a2a: all_to_all_single and a sum, RS p2p ring: isend/irecv around a ring, AG all_gather_single, AG a2a: all_to_all_single of N copies of
the chunk)."""


def markdown(table: list[dict]) -> str:
    def cell(key: str, value: object) -> str:
        if value is None:
            return "-"
        if key == "size_mib":
            return f"{value:g}"
        if isinstance(value, float):
            return f"{value:.1f}" if key.endswith("_ms") else f"{value:.2f}"
        return str(value)

    keys = [key for key in COLUMNS if any(key in row for row in table)]
    lines = ["| " + " | ".join(COLUMNS[key] for key in keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(key, row.get(key)) for key in keys) + " |" for row in table]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, type=Path, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--hosts", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--rates-gbit", nargs="+", type=float, default=[1.0, 10.0],
                        help="link rates of the emulated hosts (ignored on loopback)")
    parser.add_argument("--sizes-mib", nargs="+", type=float, default=[1, 4, 16, 64], help="float32 tensors")
    parser.add_argument("--rounds", type=int, default=9, help="measured rounds per cluster")
    parser.add_argument("--loopback", action="store_true", help="run on loopback even as root")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per cluster")
    parser.add_argument("--json", type=Path, help="write every round's times and the table here")
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    if any(h < 2 for h in args.hosts) or args.rounds < 1:
        parser.error("--hosts must be at least 2 and --rounds at least 1")
    from commsched.bench.cluster import unavailable_reason

    reason = None if args.loopback else unavailable_reason()
    if reason:
        print(f"collectives: {reason}; timing on loopback instead", file=sys.stderr)
    rates: list[float | None] = [None] if args.loopback or reason else list(args.rates_gbit)
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    record: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "commit": commit, "runs": [], "table": []}
    for hosts in args.hosts:
        for rate in rates:
            started = time.monotonic()
            times = (on_loopback(hosts, args.sizes_mib, args.rounds, args.timeout_s) if rate is None
                     else on_cluster(hosts, rate, args.sizes_mib, args.rounds, args.timeout_s))
            record["runs"].append({"hosts": hosts, "rate_gbit": rate, "seconds": times})
            record["table"] += rows(hosts, rate, times)
            print(f"{hosts} hosts, {'loopback' if rate is None else f'{rate:g} Gbit/s'}: "
                  f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(record, indent=1))
    print(f"medians of {args.rounds} interleaved rounds (ratios: medians of the per-round ratios):")
    print(markdown(record["table"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
