# Sourced by scripts/demo and scripts/test: make .venv hold torch 2.13.0 (CPU) and commsched.
# Idempotent: reinstalls only when pyproject.toml changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "commsched needs Python 3.11+"'
  "$PYTHON" -m venv "$VENV"
fi
STAMP="$VENV/.commsched-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  # torch first, pinned: left to resolve torch itself, pip would fetch a multi-GB CUDA build.
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT[test,bench,tune,lightning,hf]"
  echo "$WANT" > "$STAMP"
fi
