"""``commsched bench``: commsched against torch DDP and the physical bound on emulated hosts.

For every cell of a grid (model, link rate, number of hosts, batch size), a
fresh `EmulatedCluster` is built and one process per host is started with
torchrun (``--nnodes``, gloo bound to the host's ``eth0``). In that one run
every system trains side by side in interleaved rounds (`commsched.bench.compare`):
compute alone (every host computing, no communication), torch DDP with its
defaults, torch DDP with each ``bucket_cap_mb`` of a small sweep, torch DDP
with ``static_graph`` and ``gradient_as_bucket_view`` (at its default and the
smallest bucket size), torch FSDP2 (per block, no resharding after forward),
commsched with scheduling off, commsched with its default `Strategy`, and
commsched's parameter-server backend (``--ps-servers`` extra hosts serve; the
other systems leave them idle). One all-reduce of all gradients is timed too,
with the CPU time it costs. The bound of a cell is max(compute alone, one
all-reduce); efficiency is bound / iteration time. The parameter-server
bound is max(compute alone, the busiest server link): every worker pushes
that server's bytes in and pulls them out, so its link carries workers x
bytes in each direction. That link is timed as well, like the all-reduce
(`commsched.bench.server_link`); the table gives its time at the link's
rate beside it. *best DDP* is the fastest of every torch DDP system.

Before the comparison, each system's peak RSS is measured on its own
(`commsched.bench.memory`), once per model, hosts and batch size (memory
does not depend on the link rate): in the first run of the cell with the
fastest link, where it takes least time.

Outputs, in ``--out``: ``runs.json`` (every iteration of every run),
``results.md`` (the tables, and per cell where commsched's iteration time
goes) and ``speedup.png`` (speedup over DDP against the link rate, per model).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from commsched.bench.compare import SETTLED_AFTER
from commsched.bench.results import Cell, markdown, peak_rss, plot, summarize
from commsched.bench.systems import UNSCHEDULED, Commsched, ComputeOnly, System, TorchDDP, TorchFSDP2, decode, encode
from commsched.strategy import ParameterServer, Strategy

DDP_SWEEP_MB = (1.0, 5.0, 100.0)
"""bucket_cap_mb values tried besides DDP's default 25, for the best-DDP column."""
DDP_STATIC_MB = (None, 5.0)
"""bucket_cap_mb values (None: DDP's default) tried with static_graph and gradient_as_bucket_view."""
BATCH = {"vgg-like": 64, "resnet-like": 32, "transformer-like": 16,
         "vgg16-emulated": 32, "resnet50-emulated": 32, "gpt2-emulated": 32}
"""Per model, the default batch per host. The emulated models' batch sizes only their small real
input: the time their profile charges stands for the profile's own batch (`commsched.bench.emulated`)."""
REAL_COMPUTE = ("resnet-like", "transformer-like", "vgg-like")
"""Models whose computation runs on the host's cores: hosts share them."""
EMULATED = ("gpt2-emulated", "resnet50-emulated", "vgg16-emulated")
"""Models whose computation is a profile's per-layer times slept away: the cores stay free, as on
accelerator hosts, so 8-16 hosts fit on a few cores."""

FULL = {"models": [*REAL_COMPUTE, *EMULATED], "rates_gbit": [0.1, 0.25, 1.0, 10.0], "hosts": [2, 4], "repeats": 3,
        "rounds": 3, "iterations": 5, "warmup": 6}
"""The grid's settings, where the command line leaves them out."""
QUICK = {"models": list(REAL_COMPUTE), "rates_gbit": [0.25, 1.0], "hosts": [2], "repeats": 1, "rounds": 2,
         "iterations": 6, "warmup": 4}
"""``--quick``: 6 cells (3 models, 2 rates, 2 hosts), one repeat, fewer rounds (about 11 minutes on 2
cores). Options given on the command line win (``--quick --hosts 4``).

Each system is measured for 12 iterations per cell and repeat. With forward
overlap, commsched's iterations vary more than DDP's (one pays for what the
previous one left in flight: a standard deviation of 7% of the mean against
2-5%), so with 2 rounds of 3 its mean moved by 5-10% between runs, as much
as the differences the table is read for."""


PS_TRACE_SUBDIR = "parameter-servers"
"""Where, under the bench's ``--trace`` directory, the parameter-server system writes its trace
(both systems write one ``rank<N>.json`` per worker)."""


def lineup(
    trace_dir: str | None = None, ps_servers: int = 0, ps_block_mb: Sequence[float] = ()
) -> tuple[System, ...]:
    """The systems every cell trains; ``trace_dir`` traces the default commsched system, and the
    parameter-server one into its `PS_TRACE_SUBDIR`. Each of ``ps_block_mb`` adds a parameter-server
    system with that `ParameterServer.block_mb`, labelled ``block_mb=...``, to compare with the default."""
    chosen: list[System] = [
        ComputeOnly(), TorchDDP(), *(TorchDDP(cap) for cap in DDP_SWEEP_MB),
        *(TorchDDP(cap, static_graph=True, gradient_as_bucket_view=True) for cap in DDP_STATIC_MB),
        TorchFSDP2(), Commsched(UNSCHEDULED, "scheduling off"), Commsched(Strategy(trace_dir=trace_dir)),
    ]
    if ps_servers:
        ps_trace = None if trace_dir is None else str(Path(trace_dir) / PS_TRACE_SUBDIR)
        chosen.append(Commsched(Strategy(backend=ParameterServer(num_servers=ps_servers), trace_dir=ps_trace)))
        chosen += [Commsched(Strategy(backend=ParameterServer(num_servers=ps_servers, block_mb=mb)),
                             block_label(mb)) for mb in ps_block_mb]
    return tuple(chosen)


def block_label(block_mb: float) -> str:
    """The label of the parameter-server system with ``block_mb`` in a `lineup`."""
    return f"block_mb={block_mb:g}"


# ------------------------------------------------------------------ one cell
def worker(config_path: Path, out_path: Path) -> None:
    """Runs on every host under torchrun."""
    import torch
    import torch.distributed as dist

    from commsched.bench.compare import ComparisonConfig, allreduce_on_rank, compare_on_rank
    from commsched.bench.contention import contention_on_rank
    from commsched.bench.memory import peak_rss_in_children
    from commsched.bench.server_link import server_link_on_rank

    torch.set_num_threads(1)
    spec = json.loads(config_path.read_text())
    chosen = tuple(decode(system) for system in spec.pop("systems"))
    measure_memory = spec.pop("measure_peak_rss")
    take_profile = spec.pop("profile", False)
    config = ComparisonConfig(**spec, systems=chosen, show_progress=False)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    peaks, started = {}, time.monotonic()
    if measure_memory:  # first: the children are forked from a process that holds nothing yet
        peaks = peak_rss_in_children(config, rank, world_size, os.environ["MASTER_ADDR"],
                                     int(os.environ["MASTER_PORT"]))
    measured_memory = time.monotonic()
    import torch._dynamo  # noqa: F401 - before the group: [Note: the world group outlives destroy_process_group]
    dist.init_process_group("gloo")
    results = compare_on_rank(rank, world_size, config)
    allreduce = allreduce_on_rank(rank, world_size, config)
    server_link = server_link_on_rank(rank, world_size, config)
    contention = contention_on_rank(rank, world_size, config)
    profile = None
    if take_profile:
        from commsched.bench.in_situ import profile_on_rank

        profile = profile_on_rank(rank, world_size, config)
    if rank == 0:
        for name, peak in peaks.items():
            results[name].peak_rss_mib = peak
        phases_s = {"peak_rss": measured_memory - started, "comparison": time.monotonic() - measured_memory}
        out_path.write_text(json.dumps({"systems": {name: asdict(r) for name, r in results.items()},
                                        "allreduce": asdict(allreduce), "contention": asdict(contention),
                                        "server_link": None if server_link is None else asdict(server_link),
                                        "phases_s": phases_s,
                                        "profile": profile}))
    dist.destroy_process_group()


def cell_spec(cell: Cell, chosen: Sequence[System], rounds: int, iterations: int, warmup: int,
              measure_peak_rss: bool = False, profile: bool = False) -> dict:
    """What `worker` reads: the comparison's settings and systems, as JSON-ready data."""
    return {
        "workload": cell.model, "batch_size": cell.batch_size, "iterations": iterations,
        "rounds": rounds, "warmup": warmup, "num_servers": cell.ps_servers,
        "systems": [encode(system) for system in chosen], "measure_peak_rss": measure_peak_rss,
        "profile": profile,
    }


def run_cell(cell: Cell, chosen: Sequence[System], rounds: int, iterations: int, warmup: int,
             timeout_s: float, port: int = 29533, measure_peak_rss: bool = False, profile: bool = False) -> dict:
    """One run of ``cell`` on a fresh cluster: ``{"systems": {name: result}, "allreduce": result,
    "contention": result, "server_link": result or None, "phases_s": seconds of the peak-RSS phase and
    of the comparison, "profile": ...}`` (``contention``: `commsched.bench.contention.ContentionResult` as
    data; ``server_link``: `commsched.bench.server_link`, None without parameter servers).

    With ``measure_peak_rss``, each system's ``peak_rss_mib`` is measured first (`commsched.bench.memory`).
    With ``profile``, the model is profiled on the cell's hosts after the comparison
    (`commsched.bench.in_situ`) and ``"profile"`` holds it as JSON-ready data (else None).

    ``"cpu"`` is how busy the machine's cores were while the hosts ran, from their start to their
    end (`commsched.bench.cpu_guard.CpuUse` as data: ``median``, ``p90``, ``cores``, ``samples``,
    ``cores_set_the_pace``), so that a cell where the cores rather than the links set the pace can
    be told apart; None where ``/proc/stat`` cannot be read.
    """
    from commsched.bench.cluster import LinkSpec, run_script_on_hosts

    spec = cell_spec(cell, chosen, rounds, iterations, warmup, measure_peak_rss, profile)
    return run_script_on_hosts(["-m", "commsched.bench.grid"], cell.hosts + cell.ps_servers,
                               LinkSpec(rate_mbit=cell.rate_gbit * 1000), spec, timeout_s, str(cell), torchrun=True,
                               port=port, sample_cpu=True)


def _memory_key(cell: Cell) -> tuple:
    """What a system's memory depends on: not the link rate."""
    return cell.model, cell.hosts, cell.batch_size, cell.ps_servers


def measuring_cells(cells: Sequence[Cell]) -> set[Cell]:
    """The cells whose first run measures peak RSS: per model, hosts and batch, the one with the
    fastest link, where the short training of every system alone takes least time."""
    fastest: dict[tuple, Cell] = {}
    for cell in cells:
        known = fastest.setdefault(_memory_key(cell), cell)
        if cell.rate_gbit > known.rate_gbit:
            fastest[_memory_key(cell)] = cell
    return set(fastest.values())


def run_grid(cells: list[Cell], out: Path, rounds: int, iterations: int, warmup: int, repeats: int,
             timeout_s: float, trace_dir: Path | None = None, ps_block_mb: Sequence[float] = ()) -> list[dict]:
    """Run every cell ``repeats`` times; write ``runs.json``, ``results.md`` and ``speedup.png`` into ``out``.

    The files are rewritten after each cell, so an interrupted grid keeps what it measured. Peak RSS
    is measured once per model, hosts and batch (`measuring_cells`) and shown for all its cells.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    out.mkdir(parents=True, exist_ok=True)
    servers = {cell.ps_servers for cell in cells}
    if len(servers) != 1:
        raise ValueError("every cell of a grid uses the same number of parameter servers")
    chosen = lineup(None if trace_dir is None else str(trace_dir.resolve()), servers.pop(), ps_block_mb)
    record: dict = {"systems": [system.name for system in chosen], "cells": []}
    rows: list[dict] = []
    measuring = measuring_cells(cells)
    peaks: dict[tuple, dict[str, float] | None] = {}
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn()) as progress:
        task = progress.add_task("benchmark", total=len(cells) * repeats)
        started = time.monotonic()
        for number, cell in enumerate(cells, 1):
            runs = []
            for repeat in range(repeats):
                done = (number - 1) * repeats + repeat
                left_s = (time.monotonic() - started) / done * (len(cells) * repeats - done) if done else None
                progress.console.print(start_line(number, len(cells), cell, repeat, repeats, left_s))
                progress.update(task, description=f"{cell.model} {cell.hosts} hosts {cell.rate_gbit:g} Gbit/s")
                runs.append(run_cell(cell, chosen, rounds, iterations, warmup, timeout_s,
                                     measure_peak_rss=cell in measuring and repeat == 0))
                use = runs[-1].get("cpu")
                if use and use["cores_set_the_pace"]:
                    progress.console.print(f"  the cores set the pace: {use['median']:.0%} of {use['cores']} cores "
                                           f"busy at the median (90th percentile {use['p90']:.0%}); this run "
                                           "measures the machine, not the links")
                progress.advance(task)
            if cell in measuring:
                peaks[_memory_key(cell)] = peak_rss(runs)
            rows.append(summarize(cell, runs, chosen, peaks.get(_memory_key(cell))))
            _share_peaks(cells, rows, peaks)
            record["cells"].append({"cell": asdict(cell), "runs": runs, "summary": rows[-1]})
            (out / "runs.json").write_text(json.dumps(record, indent=1))
            (out / "results.md").write_text(markdown(rows))
    plot(rows, out / "speedup.png")
    return rows


def start_line(number: int, cells: int, cell: Cell, repeat: int, repeats: int, left_s: float | None) -> str:
    """``cell 2 of 6: vgg-like at 0.25 Gbit/s on 2 hosts, repeat 1 of 3; about 25 min left``, printed as
    each run starts, so that a long grid says where it is and roughly when it ends (the time left is
    the mean run so far times the runs left; None: no run has ended yet)."""
    servers = f" + {cell.ps_servers} server{'s' if cell.ps_servers > 1 else ''}" if cell.ps_servers else ""
    line = (f"cell {number} of {cells}: {cell.model} at {cell.rate_gbit:g} Gbit/s on {cell.hosts} hosts{servers}, "
            f"repeat {repeat + 1} of {repeats}")
    if left_s is None:
        return line
    return line + (f"; about {round(left_s / 60)} min left" if left_s >= 30 else "; under a minute left")


def _share_peaks(cells: Sequence[Cell], rows: list[dict], peaks: dict[tuple, dict[str, float] | None]) -> None:
    """Give rows run before their measuring cell its peak RSS (``rows[i]`` is ``cells[i]``'s)."""
    for cell, row in zip(cells, rows):
        if row["peak_rss_mib"] is None:
            row["peak_rss_mib"] = peaks.get(_memory_key(cell))


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The options of ``commsched bench``, added to ``parser`` (the CLI's subcommand) or to a new one."""
    parser = parser or argparse.ArgumentParser(prog="commsched bench", description=__doc__,
                                               formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="3 models, 0.25 and 1 Gbit/s, 2 hosts, one repeat, fewer rounds: about 11 minutes "
                             "on 2 cores; options given as well win (--quick --hosts 4)")
    parser.add_argument("--models", nargs="+", choices=sorted(BATCH),
                        help=f"default {FULL['models']}; the emulated ones sleep their profile's compute, leaving "
                             "the cores free as accelerator hosts do (for 8-16 hosts)")
    parser.add_argument("--rates-gbit", nargs="+", type=float, help=f"default {FULL['rates_gbit']}")
    parser.add_argument("--hosts", nargs="+", type=int,
                        help=f"workers per cell, each an emulated host (default {FULL['hosts']})")
    parser.add_argument("--batch-sizes", nargs="+", type=int,
                        help="per host, each a cell of its own (default: 64 VGG, 32 ResNet, 16 Transformer, 32 "
                             "the emulated ones)")
    parser.add_argument("--ps-servers", type=int, default=1,
                        help="extra hosts serving the parameter-server system (0 leaves it out)")
    parser.add_argument("--rounds", type=int, help=f"interleaved rounds (default {FULL['rounds']})")
    parser.add_argument("--iterations", type=int, help=f"per system per round (default {FULL['iterations']})")
    parser.add_argument("--warmup", type=int,
                        help="unmeasured iterations per system (commsched plans its order at the 4th and, where "
                             "its cost model chose partitions, measures them against whole buckets until the "
                             f"{SETTLED_AFTER}th, so it warms up at least that long; default {FULL['warmup']})")
    parser.add_argument("--repeats", type=int, help=f"fresh clusters per cell (default {FULL['repeats']})")
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--out", type=Path, default=Path("results/bench"))
    parser.add_argument("--trace", type=Path, metavar="DIR",
                        help="trace the commsched system into DIR, the parameter-server one into "
                             f"DIR/{PS_TRACE_SUBDIR} (for `commsched trace-report`; tracing adds hooks, so "
                             "its times are for diagnosis, not for the table)")
    parser.add_argument("--ps-block-mb", nargs="+", type=float, default=[], metavar="MB",
                        help="also train the parameter-server system with each of these ParameterServer.block_mb "
                             "(the default is 0.5), interleaved with the rest, and report its time against the "
                             "default's")
    return parser


def fill_in_settings(args: argparse.Namespace) -> None:
    """Settings the command line left out: `QUICK`'s with ``--quick``, else `FULL`'s."""
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def run_from_args(args: argparse.Namespace) -> int:
    """``commsched bench``: check the machine and the options, run the grid, print the table."""
    from commsched.bench.cluster import unavailable_reason

    problem = _block_sizes_problem(args.ps_block_mb, args.ps_servers)
    if problem:
        print(f"commsched bench: {problem}", file=sys.stderr)
        return 2
    reason = unavailable_reason()
    if reason:
        print(f"commsched bench: {reason}; the emulated cluster needs it. Without it, "
              "benchmarks/loopback.py compares the systems on loopback.", file=sys.stderr)
        return 2
    fill_in_settings(args)
    if any(h < 2 for h in args.hosts) or any(not r > 0 for r in args.rates_gbit) or args.ps_servers < 0:
        print("commsched bench: --hosts must be at least 2, --rates-gbit greater than 0 and --ps-servers "
              "at least 0", file=sys.stderr)
        return 2
    cells = [Cell(m, r, h, b, args.ps_servers)
             for m, h, r in itertools.product(args.models, args.hosts, args.rates_gbit)
             for b in (args.batch_sizes or [BATCH[m]])]
    rows = run_grid(cells, args.out, args.rounds, args.iterations, args.warmup, args.repeats, args.timeout_s,
                    args.trace, args.ps_block_mb)
    print(markdown(rows))
    print(f"every run: {args.out / 'runs.json'}; table: {args.out / 'results.md'}; plot: {args.out / 'speedup.png'}")
    return 0


def _block_sizes_problem(block_mb: Sequence[float], ps_servers: int) -> str | None:
    if block_mb and not ps_servers:
        return "--ps-block-mb compares parameter-server systems; give --ps-servers 1 or more"
    for mb in block_mb:
        try:
            ParameterServer(block_mb=mb)
        except ValueError as error:
            return f"--ps-block-mb: {error}"
    return None


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
