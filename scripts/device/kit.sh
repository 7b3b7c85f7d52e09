#!/usr/bin/env bash
# The kit for a lent GPU host that runs commands over a copy of this checkout and reaches no network (this
# workplace's device: an image with torch and transformers but no pydantic, gguf or RULER's packages, at most
# 64 MiB carried per call). Run here, once, where PyPI answers; it fills three ignored folders:
#   .whl/     the wheels kvpop needs there beyond the image (pydantic and its core, gguf), for CPython 3.12
#   .whl-rx/  RULER's (the kvpop[ruler] extra: nvidia-long-context-eval, nltk, wonderwords; defusedxml)
#   .devmodel-a/, .devmodel-b/  the embedded GGUF in two halves (../shared/tools/device-model.sh, where it exists)
# scripts/device/run.sh installs what a call carries of them; scripts/device/job.sh runs the pipeline there.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
for d in .whl .whl-rx .devmodel-a .devmodel-b; do
  grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
done
py=${PYTHON:-python3}
# the versions this checkout pins (pyproject.toml), and pydantic's own pins for its helpers
pin() { grep -o "\"$1==[^\";]*" pyproject.toml | head -1 | tr -d '"'; }
get() {  # wheels for CPython 3.12 on x86-64 Linux, no dependencies (the image has numpy, pyyaml, tqdm, regex, click, joblib)
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$@"
}
rm -rf .whl .whl-rx
get .whl "$(pin pydantic)" "$(pin gguf)"
core=$(unzip -p .whl/pydantic-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core *(*==\([^);]*\).*/\1/p' | head -1)
get .whl "pydantic-core==${core:?pydantic names no pydantic-core pin}" annotated-types typing-inspection
# nltk imports defusedxml, which the image lacks; the generators import none of the package's other needs but scipy (there)
# and tenacity (an H100 image lacked it on 2026-12-07; the ruler validation names it)
get .whl-rx $(grep -o '^ruler = \[.*\]' pyproject.toml | grep -o '"[^"]*"' | tr -d '"') defusedxml tenacity
if [ -x ../shared/tools/device-model.sh ] && [ ! -f .devmodel-b/SHA256 ]; then
  ../shared/tools/device-model.sh >/dev/null
fi
du -sh .whl .whl-rx .devmodel-a .devmodel-b 2>/dev/null || true
# At most 64 MiB travel per call (the checkout itself about 4): on a fresh machine carry .devmodel-a and .whl in a first call,
# .devmodel-b in a second, .whl-rx with the job in a third, each right after the last (the machine goes back after 30 s idle).
