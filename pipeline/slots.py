"""Stage slots: does the budget leave each trained policy a long-range slot on this base model?

params.yaml alone cannot tell: ``kvpop``'s mLSTM state takes slots that depend on the model's head
dim. This stage reads the base model's config (``models/base``, a declared input) and stops the run
with the key named before any train stage, whose outputs DVC would clear, runs: every ``train@``
stage depends on its marker ``data/slots.valid`` (persistent, constant content, like the validate
stage's). Inside a failing ``dvc exp run -S`` it puts the keys set back in params.yaml
(:func:`validate.stop`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvpop.modeling import model_shape
from validate import slot_errors, stop, write_marker

from common import console, fail, params

MARKER = "the budget leaves every trained policy a long-range slot on models/base\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--base", default="models/base")
    ap.add_argument("--out", default="data/slots.valid")
    args = ap.parse_args()
    p = params(args.params)
    if not (Path(args.base) / "config.json").is_file():
        fail(f"base model not found: {args.base} (run the base_model stage)")
    from types import SimpleNamespace

    from transformers import AutoConfig

    shape = model_shape(SimpleNamespace(config=AutoConfig.from_pretrained(args.base)))
    slots, errors = slot_errors(p, shape)
    if errors:
        stop("invalid params for the trained policies on this base model:\n" + "\n".join(errors), args.params)
    write_marker(args.out, MARKER)
    console.print("long-range slots per KV head: " + ", ".join(f"{n} {k}" for n, k in slots.items()), highlight=False)


if __name__ == "__main__":
    main()
