"""``commsched demo``: torch DDP and commsched side by side on this machine's loopback."""

from __future__ import annotations

import statistics

from rich.console import Console
from rich.table import Table

from commsched.bench.compare import ComparisonConfig, SystemResult, compare_on_rank
from commsched.bench.systems import TorchDDP
from commsched.testing.launch import run_ranks


def run_demo(config: ComparisonConfig, world_size: int = 2, timeout_s: float = 600.0) -> dict[str, SystemResult]:
    """Spawn ``world_size`` local ranks (gloo over loopback) and compare the systems of ``config``."""
    results = run_ranks(compare_on_rank, world_size, config, timeout_s=timeout_s)
    return results[0]


def render_report(results: dict[str, SystemResult], config: ComparisonConfig, world_size: int,
                  console: Console | None = None) -> bool:
    """Print the comparison table; return True if the losses agree to the shown precision."""
    console = console or Console(width=max(Console().width, 120))
    servers = f" (+{config.num_servers} serving the parameter-server row)" if config.num_servers else ""
    table = Table(title=(
        f"{config.workload}, {world_size} ranks{servers} on loopback (gloo), batch {config.batch_size} per "
        f"rank, {config.rounds} interleaved rounds x {config.iterations} iterations"
    ))
    for column in ("system", "median iteration (ms)", "p10-p90 (ms)", "vs torch DDP",
                   "final train loss", "held-out loss"):
        table.add_column(column, justify="left" if column == "system" else "right")
    ddp_median = results[TorchDDP().name].median_s
    for name, result in results.items():
        deciles = statistics.quantiles(result.iteration_times_s, n=10)
        table.add_row(
            name,
            f"{result.median_s * 1e3:.2f}",
            f"{deciles[0] * 1e3:.2f}-{deciles[-1] * 1e3:.2f}",
            f"{result.median_s / ddp_median:.3f}x time",
            f"{result.final_loss:.4f}",
            f"{result.eval_loss:.4f}",
        )
    console.print(table)
    shown = {(f"{r.final_loss:.4f}", f"{r.eval_loss:.4f}") for r in results.values()}
    agree = len(shown) == 1
    console.print(
        "losses agree to 4 decimals: " + ("[green]yes[/green]" if agree else "[red]NO[/red]")
    )
    console.print(
        "Loopback has no network bottleneck: communication here costs CPU, not link time, so "
        "scheduling has little to hide and small models pay for its extra collectives. "
        "`commsched bench` (root) measures emulated hosts with shaped links; docs/performance.md."
        + (" The parameter-server row sends every byte to a server and back, and its server shares "
           "the same cores." if config.num_servers else "")
    )
    return agree
