#!/usr/bin/env bash
# The main job: set up, then run the whole DVC pipeline on the embedded default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
dvc repro "$@"
python pipeline/report.py metrics/eval.json   # the quality table (dvc metrics show: the compact metrics, a row per policy)
