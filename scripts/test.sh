#!/usr/bin/env bash
# The test suite: set up, then pytest (offline, CPU; GPU-marked tests skip without CUDA), then lint (ruff, pyproject [tool.ruff]).
#   bash scripts/test.sh [fast|slow|all] [pytest arguments]
# fast (the default): every test not marked slow; slow: those marked slow (the pipeline's stages run
# end to end, DVC experiments, benchmark smoke runs, the real tokenizer, a browser); all: both.
# Arguments after the tier go to pytest (a path, -k, or a -m of your own, which wins over the tier's).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=fast
case "${1:-}" in fast | slow | all) tier=$1; shift ;; esac
case $tier in
  fast) marks=(-m "not slow") ;;
  slow) marks=(-m slow) ;;
  all) marks=() ;;
esac
KVPOP_EXTRAS=test,kernels,ruler bash scripts/setup.sh
.venv/bin/python -m pytest -q ${marks[@]+"${marks[@]}"} "$@"
.venv/bin/ruff check .
