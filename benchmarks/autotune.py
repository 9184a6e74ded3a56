"""How close does Strategy(autotune=True) get to the best setting, how fast, and how fast after the link changes?

    sudo .venv/bin/python benchmarks/autotune.py --json results/autotune.json           # the full run
    sudo .venv/bin/python benchmarks/autotune.py --quick --models resnet-like           # a smoke run

On emulated hosts (`commsched.bench.cluster.EmulatedCluster`: network
namespaces, links shaped with tc; needs root), for each bench model at each
link rate, one run of 2 hosts does, in order:

1. *the grid*: every setting of a grid (each partition size of the tuner's
   space x credit windows of 1, 2, 4, 8 partitions and none x forward overlap
   on and off, bucket caps as configured) on one prepared model, switched at
   the tuner's own switch points (one settling iteration, then
   ``--trial-iterations`` measured, their median), in ``--rounds`` rounds that
   alternate the order, so drift in machine load hits all alike; a setting's
   time is the median over rounds;
2. *the tuned run*: a fresh model with ``Strategy(autotune=True)``: the
   iterations the search took, the setting it adopted and its steady time
   (the median of the window after tuning), against the grid's best;
3. at the first rate only, *a change of link*: once tuned, the link is
   reshaped to the next rate (``EmulatedCluster.set_link``) while training
   goes on; reported: whether a re-tune started, and the iterations from the
   change until the median of the last 5 iterations is within 5% of the best
   grid time measured at the new rate (in that rate's run).

Iteration times are per rank 0, from the start of one synchronised backward
pass to the next (as the tuner measures them).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from commsched.bench import runner

MODELS = ("vgg-like", "resnet-like", "transformer-like")
BATCH = {"vgg-like": 64, "resnet-like": 32, "transformer-like": 16}
FULL = {"rates_gbit": [0.25, 1.0], "rounds": 2, "trial_iterations": 3, "after_change": 150,
        "credit_ratios": [1.0, 2.0, 4.0, 8.0, None], "overlap": [True, False]}
QUICK = {"rates_gbit": [0.25, 1.0], "rounds": 1, "trial_iterations": 2, "after_change": 40,
         "credit_ratios": [4.0, None], "overlap": [True]}
ROLLING = 5
"""Iterations in the rolling median that must come within 5% of the new best."""


@dataclass
class CellResult:
    model: str
    rate_gbit: float
    grid_ms: dict[str, float] = field(default_factory=dict)
    """Per setting (described), the median over rounds of its trial medians."""
    grid_best: str = ""
    grid_best_ms: float = 0.0
    tuned: str = ""
    tuned_ms: float = 0.0
    """The tuned run's steady median (the window after tuning)."""
    tuning_iterations: int = 0
    trials: int = 0
    trial_ms: list = field(default_factory=list)
    """The tuned run's trials: setting, median iteration time."""
    change_to_gbit: float | None = None
    after_change_ms: list[float] = field(default_factory=list)
    """Rank 0's iteration times after the link was reshaped."""
    retuned: bool = False
    iterations_to_recover: int | None = None


# ------------------------------------------------------------------ the hosts
def grid_settings(space, start, credit_ratios, overlap):
    from commsched.layout.setting import LayoutSetting

    settings = []
    for partition in space.partition_mb:
        unit = start.bucket_cap_mb if partition is None else partition
        for ratio in credit_ratios:
            credit = None if ratio is None else max(256 / 2**20, unit * ratio)
            for on in overlap:
                settings.append(LayoutSetting(partition, credit, start.bucket_cap_mb, start.first_bucket_mb, on))
    return settings


def make_grid_controller(settings, rounds, strategy):
    """Rank 0's controller for the grid: every setting, in alternating order, then stop."""
    from commsched.layout.setting import LayoutSetting
    from commsched.tuning.controller import SETTLE_ITERATIONS, Controller, TuningConfig
    from commsched.tuning.decision import Decision, Phase
    from commsched.tuning.space import SearchSpace

    class GridController(Controller):
        def __init__(self):
            start = settings[0]
            super().__init__(SearchSpace.around(1, start, True), start, strategy, TuningConfig.of(strategy))
            self.order = [s for r in range(rounds) for s in (settings if r % 2 == 0 else settings[::-1])]
            self.index = 0
            self.medians: dict[LayoutSetting, list[float]] = {}

        def decide(self, iteration):
            if self.index and self._samples:
                self.medians.setdefault(self.order[self.index - 1], []).append(statistics.median(self._samples))
            self._samples = []
            if self.index == len(self.order):
                return Decision(Phase.STOPPED, self.order[-1], 0)
            setting = self.order[self.index]
            self.index += 1
            self._measure_from = iteration + SETTLE_ITERATIONS
            return Decision(Phase.TUNING, setting, SETTLE_ITERATIONS + strategy.autotune_trial_iterations,
                            trial=self.index, trials=len(self.order))

    return GridController()


def worker(spec_path: Path, out_path: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import commsched
    from commsched.bench.models import WORKLOADS
    from commsched.layout.setting import LayoutSetting
    from commsched.strategy import Strategy
    from commsched.tuning.space import SearchSpace

    torch.set_num_threads(1)
    spec = json.loads(spec_path.read_text())
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    workload = WORKLOADS[spec["model"]]
    torch.manual_seed(0)
    base = workload.build()
    batch = BATCH[spec["model"]]
    stream = workload.batches(batch * world_size, seed=1)
    mine = slice(rank * batch, (rank + 1) * batch)
    strategy = Strategy(autotune=True, autotune_trial_iterations=spec["trial_iterations"])

    def prepared(strategy):
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return commsched.prepare(model, optimizer, strategy)

    def step(model, optimizer):
        x, y = next(stream)
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        optimizer.step()
        optimizer.zero_grad()

    result: dict = {}
    # 1. The grid, on the tuner's switch points.
    model, optimizer = prepared(strategy)
    step(model, optimizer)  # the first forward records the order; the layout exists from here on
    reducer = model._commsched_reducer
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    start = LayoutSetting.of(strategy)
    space = SearchSpace.around(gradient_bytes, start, overlap_allowed=True)
    settings = grid_settings(space, start, spec["credit_ratios"], spec["overlap"])
    if rank == 0:
        grid = make_grid_controller(settings, spec["rounds"], strategy)
        reducer._controller = grid  # the grid decides instead of the optimiser (rank 0 decides for all)
    while reducer.tuning.phase.name != "STOPPED":
        step(model, optimizer)
    if rank == 0:
        result["grid_ms"] = {s.describe(): statistics.median(m) * 1e3 for s, m in grid.medians.items()}
    commsched.release(model)

    # 2. The tuned run; 3. the link change.
    model, optimizer = prepared(strategy)
    iterations = 0
    while True:
        step(model, optimizer)
        iterations += 1
        tuning = commsched.status(model).tuning
        if tuning.baseline_ms is not None:
            break
    result.update(tuned=tuning.current.describe(), tuned_ms=tuning.baseline_ms, trials=len(tuning.trials),
                  trial_ms=[(t.setting.describe(), t.median_ms) for t in tuning.trials],
                  tuning_iterations=_tuning_iterations(tuning))
    if spec.get("change_marker"):
        marker, changed = Path(spec["change_marker"]), Path(spec["change_marker"] + ".done")
        if rank == 0:
            marker.write_text("tuned")
        times, searches, wall = [], 1, []
        last = time.perf_counter()
        for _ in range(spec["after_change"]):
            step(model, optimizer)
            now = time.perf_counter()
            times.append(now - last)
            wall.append(time.time())
            last = now
            searches = commsched.status(model).tuning.searches
        if rank == 0:
            change_at = float(changed.read_text()) if changed.exists() else None
            result["after_change_ms"] = [t * 1e3 for t, w in zip(times, wall) if change_at and w >= change_at]
            result["retuned"] = searches > 1
    commsched.release(model)
    if rank == 0:
        out_path.write_text(json.dumps(result))
    dist.destroy_process_group()


def _tuning_iterations(tuning) -> int:
    """Iterations from the end of warm-up to the adoption of the best setting."""
    from commsched.engine.lifecycle import WARMUP_ITERATIONS

    adopted = [i for i, _ in tuning.changes]
    return (max(adopted) if adopted else WARMUP_ITERATIONS) - WARMUP_ITERATIONS


# ----------------------------------------------------------------- the parent
def run_cell(model: str, rate_gbit: float, change_to: float | None, settings: dict, timeout_s: float,
             port: int) -> CellResult:
    from commsched.bench.cluster import EmulatedCluster, LinkSpec

    cell = CellResult(model, rate_gbit, change_to_gbit=change_to)
    with tempfile.TemporaryDirectory() as tmp, EmulatedCluster(2, LinkSpec(rate_mbit=rate_gbit * 1000)) as cluster:
        spec_path, out_path, marker = Path(tmp) / "spec.json", Path(tmp) / "out.json", Path(tmp) / "tuned"
        spec = {"model": model, "rounds": settings["rounds"], "trial_iterations": settings["trial_iterations"],
                "credit_ratios": settings["credit_ratios"], "overlap": settings["overlap"],
                "after_change": settings["after_change"], "change_marker": str(marker) if change_to else None}
        spec_path.write_text(json.dumps(spec))
        procs = [
            cluster.popen(host, [sys.executable, __file__, "--worker", str(spec_path), str(out_path)],
                          {**cluster.torch_env(host, port), "OMP_NUM_THREADS": "1"},
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for host in range(2)
        ]
        deadline = time.monotonic() + timeout_s
        try:
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if change_to and marker.exists() and not Path(str(marker) + ".done").exists():
                    cluster.set_link(LinkSpec(rate_mbit=change_to * 1000))
                    Path(str(marker) + ".done").write_text(repr(time.time()))
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        errors = [p.communicate()[1] for p in procs]
        for p, err in zip(procs, errors, strict=True):
            if p.returncode != 0:
                raise RuntimeError(f"a host of {model} at {rate_gbit} Gbit/s exited with {p.returncode}:\n"
                                   f"{err[-3000:]}")
        data = json.loads(out_path.read_text())
    cell.grid_ms = data["grid_ms"]
    cell.grid_best = min(cell.grid_ms, key=cell.grid_ms.get)
    cell.grid_best_ms = cell.grid_ms[cell.grid_best]
    cell.tuned, cell.tuned_ms = data["tuned"], data["tuned_ms"]
    cell.tuning_iterations, cell.trials, cell.trial_ms = data["tuning_iterations"], data["trials"], data["trial_ms"]
    cell.after_change_ms = data.get("after_change_ms", [])
    cell.retuned = data.get("retuned", False)
    return cell


def recovery(after_ms: list[float], best_ms: float) -> int | None:
    """Iterations until the median of the last `ROLLING` is within 5% of ``best_ms``."""
    for end in range(ROLLING, len(after_ms) + 1):
        if statistics.median(after_ms[end - ROLLING:end]) <= 1.05 * best_ms:
            return end
    return None


def report(cells: list[CellResult]) -> str:
    lines = ["| model | link | grid best | ms | tuned | ms | tuned / best | iterations | trials |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        lines.append(f"| {c.model} | {c.rate_gbit:g} Gbit/s | {c.grid_best} | {c.grid_best_ms:.1f} | {c.tuned} | "
                     f"{c.tuned_ms:.1f} | {c.tuned_ms / c.grid_best_ms:.3f} | {c.tuning_iterations} | {c.trials} |")
    lines += ["", "| model | link change | re-tuned | iterations to within 5% of the new grid best |", "|---|---|---|---|"]
    for c in cells:
        if c.change_to_gbit is not None:
            recovered = "not within the run" if c.iterations_to_recover is None else str(c.iterations_to_recover)
            lines.append(f"| {c.model} | {c.rate_gbit:g} -> {c.change_to_gbit:g} Gbit/s | "
                         f"{'yes' if c.retuned else 'no'} | {recovered} ({len(c.after_change_ms)} after the change) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = runner.make_parser(__doc__, summary_only=True)
    parser.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    runner.add_quick(parser, help="a smoke run: a small grid, one round")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    runner.add_rates_gbit(parser, default=None)
    runner.add_json(parser, help="write every cell's result here")
    parser.add_argument("--after-change", type=int, metavar="N",
                        help="iterations trained after the link change (default: 40 with --quick, else 150)")
    runner.add_timeout(parser, default=3600.0, help="per cell")
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    problem = runner.cluster_problem("autotune")
    if problem:
        return problem
    settings = dict(QUICK if args.quick else FULL)
    if args.rates_gbit:
        settings["rates_gbit"] = args.rates_gbit
    if args.after_change is not None:
        settings["after_change"] = args.after_change
    rates = settings["rates_gbit"]
    cells = []
    for model in args.models:
        for index, rate in enumerate(rates):
            change_to = rates[index + 1] if index == 0 and len(rates) > 1 else None
            started = time.monotonic()
            cell = run_cell(model, rate, change_to, settings, args.timeout_s, port=29611 + len(cells))
            print(f"{model} at {rate:g} Gbit/s: grid best {cell.grid_best_ms:.1f} ms ({cell.grid_best}), tuned "
                  f"{cell.tuned_ms:.1f} ms ({cell.tuned}) after {cell.tuning_iterations} iterations "
                  f"[{time.monotonic() - started:.0f} s]", flush=True)
            cells.append(cell)
        by_rate = {c.rate_gbit: c for c in cells if c.model == model}
        for c in by_rate.values():
            if c.change_to_gbit in by_rate:
                c.iterations_to_recover = recovery(c.after_change_ms, by_rate[c.change_to_gbit].grid_best_ms)
    print(report(cells))
    runner.write_json(args.json, [asdict(c) for c in cells])
    return 0


if __name__ == "__main__":
    sys.exit(main())
