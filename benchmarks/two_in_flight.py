"""Two all-reduces in flight on gloo, measured on emulated hosts, beside what the simulator's wire makes of them.

    sudo .venv/bin/python benchmarks/two_in_flight.py --hosts 8 --rate-gbit 0.5   # under a minute on 2 cores

On a fresh `EmulatedCluster` (one process per host, gloo on the host's
``eth0``), every round times, each after a barrier and as the slowest rank
saw it: one all-reduce alone of each size, and pairs issued back to back, the
older first: the time until the younger completes and until both have. The
first round is not measured; medians over the others.

Beside each pair: what `commsched.planning.wire.Wire` predicts from the
sizes alone, with the fixed cost and the per-MiB wire time of a line fitted
through the measured all-reduces alone ([Note: two collectives at once]), and
what taking them one at a time would give.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from commsched.planning.wire import Flight, Wire
from commsched.profiling.profile import fit_link
from commsched.strategy import MIB

ALONE_MIB = (0.0625, 1.0, 2.25, 9.0)
PAIRS_MIB = ((1.0, 1.0), (1.56, 1.0), (2.25, 0.0625), (2.25, 1.0), (5.49, 1.0), (9.0, 0.0625), (9.0, 1.0))
"""(older, younger): equal ones, and a small one right behind a large one, as at the end of a backward pass."""


def slowest(seconds: list[float]) -> list[float]:
    tensor = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def time_on_rank(rounds: int) -> dict | None:
    buffers = {mb: torch.zeros(int(mb * MIB) // 4) for mb in {*ALONE_MIB, *(mb for pair in PAIRS_MIB for mb in pair)}}
    younger_buffers = {mb: torch.zeros_like(buffers[mb]) for _, mb in PAIRS_MIB}
    alone: dict[str, list[float]] = {str(mb): [] for mb in ALONE_MIB}
    pairs: dict[str, list[list[float]]] = {f"{old}+{young}": [] for old, young in PAIRS_MIB}
    for round_ in range(rounds + 1):
        for mb in ALONE_MIB:
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buffers[mb])
            elapsed = slowest([time.perf_counter() - start])[0]
            if round_:
                alone[str(mb)].append(elapsed)
        for old, young in PAIRS_MIB:
            dist.barrier()
            start = time.perf_counter()
            older = dist.all_reduce(buffers[old], async_op=True)
            younger = dist.all_reduce(younger_buffers[young], async_op=True)
            younger.wait()
            young_s = time.perf_counter() - start
            older.wait()
            both_s = time.perf_counter() - start
            if round_:
                pairs[f"{old}+{young}"].append(slowest([young_s, both_s]))
    return {"alone": alone, "pairs": pairs} if dist.get_rank() == 0 else None


def worker(config_path: Path, out_path: Path) -> None:
    """One emulated host, started in its namespace with torch's env:// variables."""
    spec = json.loads(config_path.read_text())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec["timeout_s"]))
    times = time_on_rank(spec["rounds"])
    if times is not None:
        out_path.write_text(json.dumps(times))
    dist.destroy_process_group()


def on_cluster(hosts: int, rate_gbit: float, rounds: int, timeout_s: float) -> dict:
    from commsched.bench.cluster import LinkSpec, run_script_on_hosts

    return run_script_on_hosts(__file__, hosts, LinkSpec(rate_mbit=rate_gbit * 1000),
                               {"rounds": rounds, "timeout_s": timeout_s}, timeout_s,
                               f"the all-reduces on {hosts} hosts at {rate_gbit:g} Gbit/s")


def modelled_ms(fixed_s: float, per_byte_s: float, older_mb: float, younger_mb: float) -> tuple[float, float]:
    """The wire's (younger done, both done) for two all-reduces issued together, in ms."""
    wire = Wire(places=2)
    for key, mb in enumerate((older_mb, younger_mb)):
        on_wire = per_byte_s * mb * MIB
        wire.add(Flight((0, key), fixed_s + on_wire, on_wire / (fixed_s + on_wire)))
    done = {key[1]: at for key, at in wire.finish_times().items()}
    return done[1] * 1e3, max(done.values()) * 1e3


def report(times: dict) -> str:
    sizes = [float(mb) for mb in times["alone"]]
    medians = [statistics.median(seconds) for seconds in times["alone"].values()]
    fixed_s, bytes_per_s = fit_link([int(mb * MIB) for mb in sizes], medians)
    lines = [f"All-reduces alone: {', '.join(f'{mb:g} MiB {s * 1e3:.1f} ms' for mb, s in zip(sizes, medians))}; "
             f"the line through them: {fixed_s * 1e3:.1f} ms fixed, {MIB / bytes_per_s * 1e3:.1f} ms per MiB.", "",
             "| older MiB | younger MiB | younger done ms | both done ms | modelled: younger, both | "
             "one at a time: younger, both |", "|---|---|---|---|---|---|"]
    for pair, rounds in times["pairs"].items():
        older, younger = (float(mb) for mb in pair.split("+"))
        young_ms, both_ms = (statistics.median(r[i] for r in rounds) * 1e3 for i in (0, 1))
        model_young, model_both = modelled_ms(fixed_s, 1 / bytes_per_s, older, younger)
        serial = [fixed_s + mb * MIB / bytes_per_s for mb in (older, younger)]
        lines.append(f"| {older:g} | {younger:g} | {young_ms:.1f} | {both_ms:.1f} | {model_young:.1f}, "
                     f"{model_both:.1f} | {sum(serial) * 1e3:.1f}, {sum(serial) * 1e3:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, type=Path, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--rate-gbit", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--json", type=Path, help="write every round's times here")
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    from commsched.bench.cluster import unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"two_in_flight: {reason}; the emulated cluster needs it", file=sys.stderr)
        return 2
    if args.hosts < 2:
        parser.error(f"--hosts must be at least 2, got {args.hosts}")
    times = on_cluster(args.hosts, args.rate_gbit, args.rounds, args.timeout_s)
    if args.json:
        args.json.write_text(json.dumps(times, indent=1))
    print(f"{args.hosts} hosts at {args.rate_gbit:g} Gbit/s, gloo, {args.rounds} rounds, medians:\n")
    print(report(times), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
