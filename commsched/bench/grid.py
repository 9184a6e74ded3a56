"""``commsched bench``: commsched against torch DDP and the physical bound on emulated hosts.

For every cell of a grid (model, link rate, number of hosts, batch size), a
fresh `EmulatedCluster` is built and one process per host is started with
torchrun (``--nnodes``, gloo bound to the host's ``eth0``). In that one run
every system trains side by side in interleaved rounds (`commsched.bench.compare`):
compute alone (every host computing, no communication), torch DDP with its
defaults, torch DDP with each ``bucket_cap_mb`` of a small sweep, commsched
with scheduling off, commsched with its default `Strategy`, and commsched's
parameter-server backend (``--ps-servers`` extra hosts serve; the other
systems leave them idle). One all-reduce of all gradients is timed too, with
the CPU time it costs. The bound of a cell is max(compute alone, one
all-reduce); efficiency is bound / iteration time. The parameter-server
bound is max(compute alone, the busiest server link): every worker pushes
that server's bytes in and pulls them out, so its link carries workers x
bytes in each direction at the link rate.

Outputs, in ``--out``: ``runs.json`` (every iteration of every run),
``results.md`` (the table) and ``speedup.png`` (speedup over DDP against the
link rate, per model).
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from commsched.bench.results import Cell, markdown, plot, summarize
from commsched.bench.systems import UNSCHEDULED, Commsched, ComputeOnly, System, TorchDDP, decode, encode
from commsched.strategy import ParameterServer, Strategy

DDP_SWEEP_MB = (5.0, 100.0)
"""bucket_cap_mb values tried besides DDP's default 25, for the best-DDP column."""
BATCH = {"vgg-like": 64, "resnet-like": 32, "transformer-like": 16}


def lineup(trace_dir: str | None = None, ps_servers: int = 0) -> tuple[System, ...]:
    """The systems every cell trains; ``trace_dir`` traces the default commsched system."""
    chosen: list[System] = [ComputeOnly(), TorchDDP(), *(TorchDDP(cap) for cap in DDP_SWEEP_MB),
                            Commsched(UNSCHEDULED, "scheduling off"), Commsched(Strategy(trace_dir=trace_dir))]
    if ps_servers:
        chosen.append(Commsched(Strategy(backend=ParameterServer(num_servers=ps_servers))))
    return tuple(chosen)


# ------------------------------------------------------------------ one cell
def worker(config_path: Path, out_path: Path) -> None:
    """Runs on every host under torchrun."""
    import torch
    import torch.distributed as dist

    from commsched.bench.compare import ComparisonConfig, allreduce_on_rank, compare_on_rank

    torch.set_num_threads(1)
    spec = json.loads(config_path.read_text())
    chosen = tuple(decode(system) for system in spec.pop("systems"))
    config = ComparisonConfig(**spec, systems=chosen, show_progress=False)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = compare_on_rank(rank, world_size, config)
    allreduce = allreduce_on_rank(rank, world_size, config)
    if rank == 0:
        out_path.write_text(json.dumps({"systems": {name: asdict(r) for name, r in results.items()},
                                        "allreduce": asdict(allreduce)}))
    dist.destroy_process_group()


def run_cell(cell: Cell, chosen: Sequence[System], rounds: int, iterations: int, warmup: int,
             timeout_s: float, port: int = 29533) -> dict:
    """One run of ``cell`` on a fresh cluster: ``{"systems": {name: result}, "allreduce": result}``."""
    from commsched.bench.cluster import EmulatedCluster, LinkSpec

    spec = {
        "workload": cell.model, "batch_size": cell.batch_size, "iterations": iterations,
        "rounds": rounds, "warmup": warmup, "num_servers": cell.ps_servers,
        "systems": [encode(system) for system in chosen],
    }
    hosts = cell.hosts + cell.ps_servers
    with tempfile.TemporaryDirectory() as tmp, \
            EmulatedCluster(hosts, LinkSpec(rate_mbit=cell.rate_gbit * 1000)) as cluster:
        config_path, out_path = Path(tmp) / "config.json", Path(tmp) / "out.json"
        config_path.write_text(json.dumps(spec))
        procs = []
        for host in range(hosts):
            argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={hosts}",
                    "--nproc-per-node=1", f"--node-rank={host}", f"--master-addr={cluster.address(0)}",
                    f"--master-port={port}", "-m", "commsched.bench.grid", "--worker", str(config_path), str(out_path)]
            procs.append(cluster.popen(host, argv, {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"},
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        try:
            errors = [p.communicate(timeout=timeout_s)[1] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        for p, err in zip(procs, errors):
            if p.returncode != 0:
                raise RuntimeError(f"a host of {cell} exited with {p.returncode}:\n{err[-3000:]}")
        return json.loads(out_path.read_text())


def run_grid(cells: list[Cell], out: Path, rounds: int, iterations: int, warmup: int, repeats: int,
             timeout_s: float, trace_dir: Path | None = None) -> list[dict]:
    """Run every cell ``repeats`` times; write ``runs.json``, ``results.md`` and ``speedup.png`` into ``out``.

    The files are rewritten after each cell, so an interrupted grid keeps what it measured.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    out.mkdir(parents=True, exist_ok=True)
    servers = {cell.ps_servers for cell in cells}
    if len(servers) != 1:
        raise ValueError("every cell of a grid uses the same number of parameter servers")
    chosen = lineup(None if trace_dir is None else str(trace_dir.resolve()), servers.pop())
    record: dict = {"systems": [system.name for system in chosen], "cells": []}
    rows = []
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn()) as progress:
        task = progress.add_task("benchmark", total=len(cells) * repeats)
        for cell in cells:
            runs = []
            for _ in range(repeats):
                progress.update(task, description=f"{cell.model} {cell.hosts} hosts {cell.rate_gbit:g} Gbit/s")
                runs.append(run_cell(cell, chosen, rounds, iterations, warmup, timeout_s))
                progress.advance(task)
            rows.append(summarize(cell, runs, chosen))
            record["cells"].append({"cell": asdict(cell), "runs": runs, "summary": rows[-1]})
            (out / "runs.json").write_text(json.dumps(record, indent=1))
            (out / "results.md").write_text(markdown(rows))
    plot(rows, out / "speedup.png")
    return rows


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The options of ``commsched bench``, added to ``parser`` (the CLI's subcommand) or to a new one."""
    parser = parser or argparse.ArgumentParser(prog="commsched bench", description=__doc__,
                                               formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="3 models, 0.25 and 1 Gbit/s, 2 hosts, one repeat: under 10 minutes")
    parser.add_argument("--models", nargs="+", default=sorted(BATCH), choices=sorted(BATCH))
    parser.add_argument("--rates-gbit", nargs="+", type=float, default=[0.1, 0.25, 1.0, 10.0])
    parser.add_argument("--hosts", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--batch-sizes", nargs="+", type=int,
                        help="per host, each a cell of its own (default: 64 VGG, 32 ResNet, 16 Transformer)")
    parser.add_argument("--ps-servers", type=int, default=1,
                        help="extra hosts serving the parameter-server system (0 leaves it out)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=5, help="per system per round")
    parser.add_argument("--warmup", type=int, default=6,
                        help="unmeasured iterations per system (commsched plans its order at the 4th)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh clusters per cell")
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--out", type=Path, default=Path("results/bench"))
    parser.add_argument("--trace", type=Path, metavar="DIR",
                        help="trace the commsched system into DIR (for `commsched trace-report`; "
                             "tracing adds hooks, so its times are for diagnosis, not for the table)")
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    """``commsched bench``: check the machine and the options, run the grid, print the table."""
    from commsched.bench.cluster import unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"commsched bench: {reason}; the emulated cluster needs it. Without it, "
              "benchmarks/loopback.py compares the systems on loopback.", file=sys.stderr)
        return 2
    if args.quick:
        args.rates_gbit, args.hosts, args.repeats, args.rounds, args.iterations = [0.25, 1.0], [2], 1, 2, 3
    if any(h < 2 for h in args.hosts) or any(not r > 0 for r in args.rates_gbit) or args.ps_servers < 0:
        print("commsched bench: --hosts must be at least 2, --rates-gbit greater than 0 and --ps-servers "
              "at least 0", file=sys.stderr)
        return 2
    cells = [Cell(m, r, h, b, args.ps_servers)
             for m, h, r in itertools.product(args.models, args.hosts, args.rates_gbit)
             for b in (args.batch_sizes or [BATCH[m]])]
    rows = run_grid(cells, args.out, args.rounds, args.iterations, args.warmup, args.repeats, args.timeout_s,
                    args.trace)
    print(markdown(rows))
    print(f"every run: {args.out / 'runs.json'}; table: {args.out / 'results.md'}; plot: {args.out / 'speedup.png'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m commsched.bench.grid``: the grid, or with ``--worker CONFIG OUT`` one host of a cell."""
    parser = build_parser()
    parser.add_argument("--worker", nargs=2, type=Path, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    return run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
