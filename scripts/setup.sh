#!/usr/bin/env bash
# Creates .venv (Python >= 3.11) and installs kvpop with its pinned dependencies (CPU torch 2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# the extras to install (pyproject [project.optional-dependencies]): KVPOP_EXTRAS, default "test";
# scripts/test.sh adds "kernels" (Triton, for its interpreter) and "ruler" (RULER's generators, for tests/test_ruler.py)
extras=${KVPOP_EXTRAS:-test}
stamp=".venv/.kvpop-installed-${extras//,/-}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[$extras]"
  touch "$stamp"
fi
