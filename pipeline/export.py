"""Stage export: a trained Lightning checkpoint to safetensors + JSON, loadable without Lightning.

``--ckpt`` is a checkpoint file (single device, DDP, FSDP ``full``) or an FSDP ``sharded`` folder;
both give the same export layout.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvpop import tracking
from kvpop.export import CheckpointError, export, load_training_state
from kvpop.modeling import load_model, model_shape
from kvpop.train import training_policy

from common import console, fail, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--ckpt", required=True, help="Lightning checkpoint file, or FSDP sharded checkpoint folder")
    ap.add_argument("--base", default="models/base")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    p = params()
    ckpt = Path(args.ckpt)
    if not ckpt.exists():
        fail(f"checkpoint not found: {ckpt} (run the train stage)")
    try:  # a file, or an FSDP sharded folder consolidated here: the same state_dict either way
        state = load_training_state(ckpt)
    except CheckpointError as err:
        fail(str(err))
    from transformers import AutoTokenizer

    model = load_model(args.base)
    shape = model_shape(model)
    policy = training_policy(args.policy, shape, p.train.for_policy(args.policy))  # the policy its run trained (a pool's floor included)
    student_sd = {k.removeprefix("student."): v for k, v in state.items() if k.startswith("student.")}
    policy_sd = {k.removeprefix("policy."): v for k, v in state.items() if k.startswith("policy.")}
    if not student_sd:
        fail(f"{ckpt} holds no student weights")
    missing, unexpected = model.load_state_dict(student_sd, strict=False)
    missing = [m for m in missing if not m.endswith("lm_head.weight")]  # tied to the embeddings
    if missing or unexpected:
        fail(f"{ckpt} does not match {args.base}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    policy.load_state_dict(policy_sd)
    tok = AutoTokenizer.from_pretrained(args.base)
    logged = {"policy": args.policy, "budget": p.budget, "sinks": p.sinks, "window": p.window}
    with tracking.stage_run("export", logged, run_name=f"export/{args.policy}") as run:
        export(model, tok, policy, Path(args.out), layout=p.layout)
        run.artifact(Path(args.out) / "kvpop.json")
    console.print(f"exported {args.policy} -> {args.out}")


if __name__ == "__main__":
    main()
