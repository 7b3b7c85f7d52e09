"""Stage base_model: materialize the teacher as a safetensors Hugging Face folder."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvpop import tracking
from kvpop.base_model import ModelSourceError, materialize

from common import console, fail, params, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="models/base")
    ap.add_argument("--metrics", default="metrics/base_model.json")
    ap.add_argument("--cache", default=".cache/embedded", help="where the embedded GGUF is kept")
    args = ap.parse_args()
    p = params()
    cfg = p.base_model
    with tracking.stage_run("base_model", {"base_model": cfg.model_dump()}) as run:
        console.print(f"[bold]base_model[/]: {cfg.source} -> {args.out}")
        try:
            summary = materialize(cfg.source, Path(args.out), dtype=cfg.dtype, cache_dir=Path(args.cache))
        except ModelSourceError as err:
            fail(str(err))
        write_json(args.metrics, summary)
        run.metrics({"parameters": summary["parameters"], "num_layers": summary["num_layers"]})
        run.artifact(args.metrics)
    console.print(summary)


if __name__ == "__main__":
    main()
