"""Stage pack: filtered traces -> fixed-length rows of train.seq_len tokens (document ids, positions, loss mask)."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from kvpop import tracking
from kvpop.filter import read_jsonl
from kvpop.pack import pack_records, save_packed

from common import console, fail, params, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", default="data/filtered/train.jsonl")
    ap.add_argument("--base", default="models/base", help="teacher folder (for the pad token)")
    ap.add_argument("--out", default="data/packed/train.safetensors")
    ap.add_argument("--metrics", default="metrics/pack.json")
    args = ap.parse_args()
    p = params()
    try:
        records = read_jsonl(args.data)
    except (FileNotFoundError, ValueError) as err:
        fail(str(err))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.base)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with tracking.stage_run("pack", {"train.seq_len": p.train.seq_len}) as run:
        packed = pack_records(records, seq_len=p.train.seq_len, pad_id=pad_id)
        if packed.stats.rows == 0:
            fail(f"no document fits train.seq_len={p.train.seq_len} ({packed.stats.skipped_too_long} too long)")
        save_packed(packed, Path(args.out))
        stats = asdict(packed.stats)
        write_json(args.metrics, stats)
        run.metrics(stats)
    console.print(stats)


if __name__ == "__main__":
    main()
