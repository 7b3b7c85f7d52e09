#!/usr/bin/env bash
# The test suite: set up, then pytest (offline, CPU; GPU-marked tests skip without CUDA), then lint (ruff, pyproject [tool.ruff]).
set -euo pipefail
cd "$(dirname "$0")/.."
KVPOP_EXTRAS=test,kernels,ruler bash scripts/setup.sh
.venv/bin/python -m pytest -q "$@"
.venv/bin/ruff check .
