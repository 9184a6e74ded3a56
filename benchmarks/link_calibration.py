"""How steady the cost model's link calibration is, on emulated hosts (root).

    .venv/bin/python benchmarks/link_calibration.py --rates-gbit 1 0.25 --calibrations 60

The cost model prices a partitioning with the link it measures once, at the
end of warm-up (`commsched.planning.plans.calibrate`): a round trip, and a line
``fixed cost + bytes / bandwidth`` through all-reduces of two sizes. One
calibration that comes out wrong decides the partitioning for the whole run,
so what matters is how often it is far off, not its median. Per link rate,
two hosts (`commsched.bench.cluster.EmulatedCluster`, gloo) calibrate
``--calibrations`` times back to back, as every rank does in a run, for the
bench's VGG-like (13 MB of gradients); reported from rank 0, which runs the
cost model: the fixed cost per collective and the bandwidth (median, 90th
percentile, largest, and how many fixed costs exceed ``--far-ms``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GRADIENT_BYTES = 13 * 2**20
"""About the VGG-like's gradients: the calibration's larger all-reduce is capped at 8 MiB anyway."""


def worker(calibrations: int, out_path: Path) -> None:
    import torch
    import torch.distributed as dist

    from commsched.planning.calibration import measure_latency, measure_link

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group, device, samples = dist.group.WORLD, torch.device("cpu"), []
    for _ in range(calibrations):
        latency_s = measure_latency(group, device, timeout_s=120)
        link, _ = measure_link(group, device, GRADIENT_BYTES, latency_s, timeout_s=120)
        samples.append({"round_trip_s": latency_s, "fixed_s": link.latency_s, "bytes_per_s": link.bytes_per_s})
    if dist.get_rank() == 0:
        out_path.write_text(json.dumps(samples))
    dist.destroy_process_group()


def run_rate(rate_gbit: float, calibrations: int, timeout_s: float, port: int) -> list[dict]:
    from commsched.bench.cluster import EmulatedCluster, LinkSpec, wait_for_hosts

    with tempfile.TemporaryDirectory() as tmp, EmulatedCluster(2, LinkSpec(rate_mbit=rate_gbit * 1000)) as cluster:
        out_path = Path(tmp) / "samples.json"
        procs = [
            cluster.popen(host, [sys.executable, __file__, "--worker", str(calibrations), str(out_path)],
                          {**cluster.torch_env(host, port), "OMP_NUM_THREADS": "1"},
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for host in range(2)
        ]
        wait_for_hosts(procs, timeout_s, f"the calibrations at {rate_gbit:g} Gbit/s")
        return json.loads(out_path.read_text())


def summary(rate_gbit: float, samples: list[dict], far_ms: float) -> str:
    fixed_ms = [s["fixed_s"] * 1e3 for s in samples]
    mb_per_s = [s["bytes_per_s"] / 1e6 for s in samples]
    p90 = statistics.quantiles(fixed_ms, n=10)[-1] if len(fixed_ms) > 1 else fixed_ms[0]
    far = sum(ms > far_ms for ms in fixed_ms)
    return (f"| {rate_gbit:g} | {len(samples)} | {statistics.median(fixed_ms):.3f} | {p90:.3f} | {max(fixed_ms):.3f} "
            f"| {far} | {statistics.median(mb_per_s):.1f} | {min(mb_per_s):.1f}-{max(mb_per_s):.1f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--rates-gbit", nargs="+", type=float, default=[1.0, 0.25])
    parser.add_argument("--calibrations", type=int, default=60, help="per rate")
    parser.add_argument("--far-ms", type=float, default=1.0, help="a fixed cost above this counts as far off")
    parser.add_argument("--json", type=Path, help="write every calibration here")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per rate")
    args = parser.parse_args(argv)
    if args.worker:
        worker(int(args.worker[0]), Path(args.worker[1]))
        return 0
    if args.calibrations < 1:
        parser.error("--calibrations must be at least 1")
    from commsched.bench.cluster import unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"link_calibration: {reason}; it needs the emulated cluster", file=sys.stderr)
        return 2
    rows, every = [], {}
    for index, rate in enumerate(args.rates_gbit):
        started = time.monotonic()
        every[rate] = run_rate(rate, args.calibrations, args.timeout_s, port=29711 + index)
        rows.append(summary(rate, every[rate], args.far_ms))
        print(f"{rate:g} Gbit/s: {args.calibrations} calibrations [{time.monotonic() - started:.0f} s]", flush=True)
    print(f"| Gbit/s | calibrations | fixed cost ms, median | 90th percentile | largest | above {args.far_ms:g} ms "
          "| MB/s, median | MB/s, range |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({str(rate): samples for rate, samples in every.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
