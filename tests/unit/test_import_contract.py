"""The package's structure holds: the import contract, and a training job loads no tooling."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[2]


def test_import_contract_is_kept(monkeypatch):
    """The layers and the no-cycle contract in pyproject.toml ([tool.importlinter])."""
    monkeypatch.chdir(ROOT)
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True) == 0


def test_importing_commsched_loads_no_tooling():
    """``import commsched`` (what a training job does) loads neither the bench, the CLI,
    the test harness, nor their dependencies."""
    code = "import commsched, sys, json; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                       text=True, cwd=ROOT).stdout)
    tooling = [m for m in loaded if m.split(".")[0] in {"rich", "matplotlib"}
               or m.startswith(("commsched.bench", "commsched.cli", "commsched.testing"))]
    assert "commsched.engine.reducer" in loaded and tooling == [], tooling
