"""How often a small all-reduce stalls on the emulated hosts, with Linux's delayed ACKs and without.

    sudo .venv/bin/python benchmarks/ack_stalls.py --hosts 2 4 8      # about 3 minutes on 2 cores

Per host count, fresh clusters (the ones ``commsched bench`` builds) alternate
between hosts whose routes acknowledge at once (``quickack``, as the bench
runs them: [Note: immediate ACKs on the emulated hosts] in
`commsched.bench.cluster`) and hosts with Linux's delayed ACKs. On each, every
rank all-reduces one float32 tensor ``--count`` times, a few milliseconds
apart as gradients are, and each all-reduce's time is the slowest rank's.
Reported per cluster: the median, the 90th percentile and the longest time,
and how many took more than twice the median (stalls).
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

MIB = 2**20


def time_on_rank(size_mib: float, count: int) -> list[float] | None:
    """``count`` all-reduces of ``size_mib``, 0-8 ms apart, after 10 untimed; rank 0 gets the slowest
    rank's time of each (None elsewhere)."""
    tensor = torch.zeros(int(size_mib * MIB) // 4)
    seconds = []
    for i in range(count + 10):
        time.sleep(0.004 * (i % 3))
        start = time.perf_counter()
        dist.all_reduce(tensor)
        if i >= 10:
            seconds.append(time.perf_counter() - start)
    slowest = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist() if dist.get_rank() == 0 else None


def worker(config_path: Path, out_path: Path) -> None:
    """One emulated host, started in its namespace with torch's env:// variables."""
    spec = json.loads(config_path.read_text())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec["timeout_s"]))
    seconds = time_on_rank(spec["size_mib"], spec["count"])
    if seconds is not None:
        out_path.write_text(json.dumps(seconds))
    dist.destroy_process_group()


def summary(seconds: list[float]) -> dict:
    ms = sorted(s * 1e3 for s in seconds)
    median = statistics.median(ms)
    return {"median_ms": median, "p90_ms": ms[int(0.9 * (len(ms) - 1))], "max_ms": ms[-1],
            "stalls": sum(m > 2 * median for m in ms), "count": len(ms)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, type=Path, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--hosts", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--rate-gbit", type=float, default=0.5)
    parser.add_argument("--size-mib", type=float, default=0.5, help="the tensor all-reduced (float32)")
    parser.add_argument("--count", type=int, default=290, help="timed all-reduces per cluster")
    parser.add_argument("--repeats", type=int, default=2, help="clusters of each kind per host count, alternating")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per cluster")
    parser.add_argument("--json", type=Path, help="write every time and the table here")
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    if any(h < 2 for h in args.hosts) or args.count < 1 or args.repeats < 1 or args.size_mib <= 0:
        parser.error("--hosts must be at least 2, --count and --repeats at least 1, --size-mib positive")
    from commsched.bench.cluster import LinkSpec, run_script_on_hosts, unavailable_reason

    reason = unavailable_reason()
    if reason:
        parser.error(f"the emulated hosts are needed: {reason}")
    config = {"size_mib": args.size_mib, "count": args.count, "timeout_s": args.timeout_s}
    rows = []
    for hosts in args.hosts:
        for repeat in range(args.repeats):
            for immediate in (True, False):
                acks = "at once" if immediate else "delayed"
                seconds = run_script_on_hosts(__file__, hosts, LinkSpec(rate_mbit=args.rate_gbit * 1000), config,
                                              args.timeout_s, f"{args.size_mib:g} MiB all-reduces on {hosts} hosts",
                                              immediate_acks=immediate)
                rows.append({"hosts": hosts, "acks": acks, "repeat": repeat, **summary(seconds), "seconds": seconds})
                print(f"{hosts} hosts, ACKs {acks}: done", file=sys.stderr, flush=True)
    print(f"{args.count} all-reduces of {args.size_mib:g} MiB per cluster at {args.rate_gbit:g} Gbit/s, "
          "the slowest rank's time:")
    print("| hosts | ACKs | median ms | p90 ms | max ms | over twice the median |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['hosts']} | {r['acks']} | {r['median_ms']:.1f} | {r['p90_ms']:.1f} | {r['max_ms']:.1f} | "
              f"{r['stalls']} of {r['count']} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
