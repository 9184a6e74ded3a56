"""The rows of a plan and what ``commsched plan`` prints and draws of them: the table of predicted\niteration times and speedups, the Strategy to write, and the plot of speedup against workers."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from commsched.profiling.profile import Profile
from commsched.strategy import Strategy


# ---------------------------------------------------------------- the plan
@dataclass(frozen=True)
class PlanRow:
    """One cluster: each system's simulated iteration time, the bound, and the fastest strategy."""

    workers: int
    gbit_s: float
    ddp_s: float
    default_s: float
    best_s: float
    bound_s: float
    best: Strategy

    @property
    def speedup(self) -> float:
        """The best strategy's speedup over torch DDP with its defaults."""
        return self.ddp_s / self.best_s


def strategy_code(strategy: Strategy) -> str:
    """``strategy`` as the Python that builds it, naming only what differs from ``Strategy()``.

    Bucket limits that the partition size overrides (buckets are capped at it)
    are left at their defaults, so the code says only what matters.
    """
    default = Strategy()
    for name in ("bucket_cap_mb", "first_bucket_mb"):
        simpler = dataclasses.replace(strategy, **{name: getattr(default, name)})
        if (simpler.bucket_size_limits_bytes == strategy.bucket_size_limits_bytes
                and simpler.ps_block_bytes == strategy.ps_block_bytes):
            strategy = simpler
    return _code(strategy)


def _code(value: object) -> str:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        try:
            default = type(value)()
        except TypeError:  # no defaults to differ from
            return repr(value)
        changed = [
            f"{field.name}={_code(getattr(value, field.name))}"
            for field in dataclasses.fields(value)
            if getattr(value, field.name) != getattr(default, field.name)
        ]
        return f"{type(value).__name__}({', '.join(changed)})"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, float):
        return f"{value:g}"
    return repr(value)


# -------------------------------------------------------------- the output
HEADERS = ("workers", "Gbit/s", "DDP ms", "commsched default ms", "best ms", "bound ms", "best vs DDP",
           "recommended")


def table_cells(rows: Sequence[PlanRow]) -> list[tuple[str, ...]]:
    return [
        (str(r.workers), f"{r.gbit_s:g}", f"{r.ddp_s * 1e3:.2f}", f"{r.default_s * 1e3:.2f}",
         f"{r.best_s * 1e3:.2f}", f"{r.bound_s * 1e3:.2f}", f"{r.speedup:.2f}x", strategy_code(r.best))
        for r in rows
    ]


def describe_profile(profile: Profile, scale: float) -> str:
    scaled = f", compute times x{scale:g}" if scale != 1 else ""
    link = ""
    if profile.link is not None:
        link = (f"; measured link among {profile.link.world_size}: {profile.link.latency_s * 1e6:.0f} us + "
                f"n / {profile.link.bytes_per_s * 8 / 1e9:.2f} Gbit/s, computation {profile.link.compute_slowdown:.0%}"
                " slower beside it")
    return (
        f"{profile.model} on {profile.device}, batch {profile.batch_size} per worker: forward "
        f"{profile.forward_s * 1e3:.2f} ms, backward {profile.backward_s * 1e3:.2f} ms, update "
        f"{profile.update_s * 1e3:.2f} ms{scaled}; {len(profile.parameters)} gradients, "
        f"{profile.gradient_bytes / 2**20:.1f} MiB{link}"
    )


def render(rows: Sequence[PlanRow], title: str, notes: Sequence[str] = ()) -> str:
    """The table as text (with rich where it is installed, plain columns otherwise), then ``notes``."""
    cells = table_cells(rows)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return _plain(cells, title, notes)
    table = Table(title=title, title_justify="left")
    for header in HEADERS:
        table.add_column(header, justify="left" if header == "recommended" else "right",
                         no_wrap=header == "recommended")
    for row in cells:
        table.add_row(*row)
    width = sum(max(len(h), *(len(c[i]) for c in cells)) + 3 for i, h in enumerate(HEADERS)) + 1
    out = io.StringIO()
    console = Console(file=out, width=max(width, 100))
    console.print(table)
    return "".join(line.rstrip() + "\n" for line in [*out.getvalue().splitlines(), *notes])


def _plain(cells: Sequence[Sequence[str]], title: str, notes: Sequence[str]) -> str:
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(HEADERS)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if i == len(widths) - 1 else v.rjust(w)
                         for i, (v, w) in enumerate(zip(values, widths))).rstrip()

    return "\n".join([title, line(HEADERS), *(line(c) for c in cells), *notes]) + "\n"


def plot(rows: Sequence[PlanRow], path: Path, title: str) -> Path:
    """Speedup of the best strategy over torch DDP against the number of workers, one line per link rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for gbit in sorted({r.gbit_s for r in rows}):
        mine = sorted((r for r in rows if r.gbit_s == gbit), key=lambda r: r.workers)
        ax.plot([r.workers for r in mine], [r.speedup for r in mine], "o-", label=f"{gbit:g} Gbit/s")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xscale("log", base=2)
    counts = sorted({r.workers for r in rows})
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.minorticks_off()
    ax.set_xlabel("workers")
    ax.set_ylabel("best Strategy's speedup over torch DDP")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
