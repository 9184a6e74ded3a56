"""What every script in ``benchmarks/`` needs besides its question: its options, the check that
this machine can build emulated hosts, runs on fresh ones, and the JSON of what it measured.

The JSON has one shape, so that a saved run says where it came from: the command line, the commit
(where the code is a git checkout), the machine, and the script's ``rows``; a script may add fields
of its own (``write_json(path, rows, part="error")``). Each option keeps the name and default the
scripts gave it, and a script passes its own default and help where they differ.

    parser = runner.make_parser(__doc__)
    runner.add_hosts(parser, default=[2, 4])
    runner.add_repeats(parser, default=3, help="fresh clusters per cell")
    runner.add_json(parser)
    args = parser.parse_args(argv)
    runner.refuse_below_one(parser, args, "repeats")
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

CHECKOUT = Path(__file__).resolve().parents[2]
"""Where commsched's source lives; a git checkout there names the commit a run measured."""


# ------------------------------------------------------------------ options
def make_parser(doc: str | None, summary_only: bool = False) -> argparse.ArgumentParser:
    """A parser whose ``--help`` shows the script's docstring as written (its commands included), or
    with ``summary_only`` its first paragraph."""
    if summary_only and doc:
        return argparse.ArgumentParser(description=doc.split("\n\n")[0])
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_json(parser: argparse.ArgumentParser, help: str = "write every run here") -> None:
    """``--json PATH``: where `write_json` writes the run (none without it)."""
    parser.add_argument("--json", type=Path, metavar="PATH", help=help)


def add_repeats(parser: argparse.ArgumentParser, default: int,
                help: str = "fresh process groups or clusters per cell") -> None:
    """``--repeats N``: one run is noisy, so comparisons repeat on fresh processes."""
    parser.add_argument("--repeats", type=int, default=default, help=help)


def add_hosts(parser: argparse.ArgumentParser, default: Sequence[int] | None, help: str | None = None) -> None:
    """``--hosts N ...``: emulated hosts per cell, one process each."""
    parser.add_argument("--hosts", nargs="+", type=int, default=None if default is None else list(default), help=help)


def add_rate_gbit(parser: argparse.ArgumentParser, default: float, help: str = "every host's link") -> None:
    """``--rate-gbit R``: one link rate for every cell."""
    parser.add_argument("--rate-gbit", type=float, default=default, help=help)


def add_rates_gbit(parser: argparse.ArgumentParser, default: Sequence[float] | None, help: str | None = None) -> None:
    """``--rates-gbit R ...``: a cell per link rate (None: the script fills it in, as with ``--quick``)."""
    parser.add_argument("--rates-gbit", nargs="+", type=float, default=None if default is None else list(default),
                        help=help)


def add_world_sizes(parser: argparse.ArgumentParser, default: Sequence[int] | None, help: str | None = None) -> None:
    """``--world-sizes N ...``: loopback ranks per cell."""
    parser.add_argument("--world-sizes", nargs="+", type=int, default=None if default is None else list(default),
                        help=help)


def add_quick(parser: argparse.ArgumentParser, help: str) -> None:
    """``--quick``: a smaller run, to see that it works before paying for the full one."""
    parser.add_argument("--quick", action="store_true", help=help)


def add_timeout(parser: argparse.ArgumentParser, default: float, help: str | None = None) -> None:
    """``--timeout-s S``: a run that hangs is killed rather than waited for."""
    parser.add_argument("--timeout-s", type=float, default=default, help=help)


def refuse_below_one(parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """Exit through ``parser.error`` where a count in ``names`` is below one: a run of no repeats
    would build its clusters and then have nothing to report."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")


# ------------------------------------------------------------------ emulated hosts
def cluster_problem(script: str) -> int | None:
    """2, having said why on stderr, where this machine cannot build emulated hosts (no root, no
    iproute2); None where it can. Asked before any work, so that a run without root fails at once."""
    from commsched.bench.cluster import unavailable_reason

    reason = unavailable_reason()
    if reason is None:
        return None
    print(f"{script}: {reason}; it needs the emulated cluster", file=sys.stderr)
    return 2


def on_emulated_hosts(script: str | Sequence[str], hosts: int, rate_gbit: float, config: Mapping[str, Any],
                      timeout_s: float, what: str, torchrun: bool = False, port: int = 29500,
                      sample_cpu: bool = False) -> Any:
    """``script --worker CONFIG OUT`` on ``hosts`` fresh emulated hosts whose links run at
    ``rate_gbit``; what its rank 0 wrote to OUT (`commsched.bench.cluster.run_script_on_hosts`)."""
    from commsched.bench.cluster import LinkSpec, run_script_on_hosts

    return run_script_on_hosts(script, hosts, LinkSpec(rate_mbit=rate_gbit * 1000), config, timeout_s, what,
                               torchrun=torchrun, port=port, sample_cpu=sample_cpu)


# ------------------------------------------------------------------ the JSON
def commit(checkout: Path = CHECKOUT) -> str | None:
    """``git describe --always --dirty`` of ``checkout`` (None where it is no git checkout)."""
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=checkout, capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def machine() -> dict[str, Any]:
    """What a figure depends on besides the code: the platform, the cores this process may use,
    Python's and torch's versions, and the GPU where this process has started CUDA (asking
    otherwise would start it, which forked ranks cannot inherit)."""
    from commsched.bench.cpu_guard import usable_cpus

    usable = usable_cpus()
    found: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count(),
                             "usable_cpus": None if usable is None else len(usable),
                             "python": platform.python_version(), "torch": None, "gpu": None}
    torch = sys.modules.get("torch")
    if torch is not None:
        found["torch"] = torch.__version__
        if torch.cuda.is_initialized():
            found["gpu"] = torch.cuda.get_device_name()
    return found


def record(rows: Any, argv: Sequence[str] | None = None, **fields: Any) -> dict[str, Any]:
    """The JSON of a run: ``command``, ``commit``, ``machine``, ``fields`` and ``rows``."""
    return {"command": shlex.join(sys.argv if argv is None else argv), "commit": commit(), "machine": machine(),
            **fields, "rows": rows}


def write_json(path: Path | str | None, rows: Any, **fields: Any) -> None:
    """Write `record` to ``path`` (its folders made); nothing where ``path`` is None (no ``--json``).
    Scripts call it after each cell, so an interrupted run keeps what it measured."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record(rows, **fields), indent=1) + "\n")


def read_rows(path: Path | str) -> Any:
    """The rows of a run `write_json` saved; a file of rows alone (as runs saved before) as it is."""
    saved = json.loads(Path(path).read_text())
    return saved["rows"] if isinstance(saved, dict) and "rows" in saved and "command" in saved else saved
