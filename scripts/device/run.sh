#!/usr/bin/env bash
# On the GPU host, in its copy of the checkout: install what this call carries of the kit (scripts/device/kit.sh),
# then run the command given.
#   bash scripts/device/run.sh true                                   # carry .devmodel-a (half the model) and .whl
#   bash scripts/device/run.sh true                                   # then carry .devmodel-b, then .whl-rx with the job
#   bash scripts/device/run.sh python3 bench/bench_decode.py --parts b1,pooled   # any command, once the kit is in
# What it installs stays under /tmp while the machine stays warm: the wheels in /tmp/site, the model in
# /tmp/devmodel (checked against the SHA256 kit.sh recorded). Later calls carry nothing of the kit.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src KVPOP_TRACKING=off  # src: bench scripts run as they are
mkdir -p /tmp/devmodel /tmp/site
gguf=/tmp/devmodel/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f .devmodel-a/part_aa ]; then cp .devmodel-a/part_aa /tmp/devmodel/ || exit; fi
if [ -f .devmodel-b/part_ab ] && [ ! -f "$gguf" ]; then
  [ -f /tmp/devmodel/part_aa ] || { echo "run.sh: .devmodel-b came before .devmodel-a (a fresh machine: carry .devmodel-a first)" >&2; exit 2; }
  cat /tmp/devmodel/part_aa .devmodel-b/part_ab > "$gguf.part" && echo "$(cat .devmodel-b/SHA256)  $gguf.part" | sha256sum -c --quiet &&
    mv "$gguf.part" "$gguf" || { rm -f "$gguf.part"; echo "run.sh: the model's halves do not match their SHA256" >&2; exit 2; }
fi
for d in .whl .whl-rx; do
  if compgen -G "$d/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$d"/*.whl || exit
  fi
done
if [ -f "$gguf" ] && [ ! -f ".cache/embedded/${gguf##*/}" ]; then mkdir -p .cache/embedded && cp "$gguf" .cache/embedded/; fi
"$@"
