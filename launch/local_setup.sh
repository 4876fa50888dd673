#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv in this checkout and install stare_jax into it.
#   bash launch/local_setup.sh        runtime dependencies (what `stare-jax demo` needs)
#   bash launch/local_setup.sh test   plus the test dependencies (torch CPU, transformers, pytest, ...)
# Versions are pinned by constraints.txt (the exact set tested). Needs only Python >= 3.11 on PATH.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
py="${PYTHON:-}"
if [ -z "$py" ]; then
  for cand in python3.11 python3.12 python3; do
    if command -v "$cand" >/dev/null 2>&1; then py="$cand"; break; fi
  done
fi
[ -n "$py" ] || { echo "local_setup: no python3 found on PATH (need Python >= 3.11)" >&2; exit 1; }
"$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
  || { echo "local_setup: $py is $("$py" --version 2>&1); stare_jax needs Python >= 3.11" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
req=requirements.txt
[ "${1:-}" = "test" ] && req=requirements-test.txt
stamp=".venv/.stare_jax_installed_$(cat "$req" requirements.txt constraints.txt pyproject.toml | cksum | cut -d' ' -f1)_${1:-run}"
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -r "$req" 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e . 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -c "import stare_jax, jax, flax" || { echo "local_setup: install failed" >&2; exit 1; }
  [ "${1:-}" = "test" ] && { .venv/bin/python -c "import torch, transformers, pytest" || { echo "local_setup: test install failed" >&2; exit 1; }; }
  touch "$stamp"
fi
