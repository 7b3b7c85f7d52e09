"""A profile: a named set of params overrides (``profiles/<name>.yaml``), applied the way DVC applies ``-S``.

A profile file holds a partial params tree (the keys it changes, nested as in params.yaml). This
script merges it over ``--params`` (default ``params.yaml``), validates the result with
:mod:`kvpop.config` (a bad key or value stops here, naming it, with nothing written), and then

* prints the overrides as ``-S key=value`` arguments for ``dvc exp run`` (the default)::

      dvc exp run -n 4k $(python pipeline/profiles.py 4k)

* or, with ``--write PATH``, writes the merged params to PATH (``--write params.yaml`` on a machine
  without DVC that runs the stages with ``pipeline/run_stages.py``).

``4k`` is ``profiles/4k.yaml``; a path to any YAML file works too. Lists and mappings are printed in
YAML flow style without spaces, so the shell's word splitting of ``$(...)`` keeps each one whole.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from kvpop.config import ParamsError, parse_params, read_mapping

PROFILES = Path(__file__).resolve().parent.parent / "profiles"


def profile_path(name: str) -> Path:
    """``profiles/<name>.yaml`` for a bare name, else ``name`` as a path."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") or path.parent != Path("."):
        return path
    return PROFILES / f"{name}.yaml"


def read_yaml(path: Path) -> dict:
    known = ", ".join(sorted(p.stem for p in PROFILES.glob("*.yaml"))) if PROFILES.is_dir() else "none"
    return read_mapping(path, missing=f"profile not found (profiles: {known})")


def leaves(tree: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf of a profile; a mapping is descended, any other value is a leaf."""
    out = []
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += leaves(value, dotted + ".")
        else:
            out.append((dotted, value))
    return out


def merged(base: dict, overrides: list[tuple[str, Any]]) -> dict:
    """``base`` with each dotted key set to its value (a copy; missing levels are created)."""
    out = yaml.safe_load(yaml.safe_dump(base))  # a deep copy of plain YAML data
    for dotted, value in overrides:
        node = out
        *path, last = dotted.split(".")
        for part in path:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[last] = value
    return out


def flow(value: Any) -> str:
    """One shell word: YAML flow style without spaces (``[a,b]``, ``{code:4,prose:4}``), scalars as YAML reads them back."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()
    text = text.removesuffix("\n...").strip()
    if isinstance(value, (list, dict)):
        text = text.replace(", ", ",").replace(": ", ":")
    if " " in text:
        raise ParamsError(f"value {value!r} holds a space: set it with -S by hand")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", help="a name under profiles/ (4k, 8k) or a YAML file")
    ap.add_argument("--params", default="params.yaml", help="the params the profile overrides")
    ap.add_argument("--write", help="write the merged params here instead of printing -S arguments")
    args = ap.parse_args()
    try:
        overrides = leaves(read_yaml(profile_path(args.profile)))
        base = read_mapping(args.params)
        params = merged(base, overrides)
        parse_params(params)  # every key validated before anything is written or run
    except ParamsError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.write:
        Path(args.write).write_text(yaml.safe_dump(params, sort_keys=False))
        print(f"wrote {args.write}: {args.params} with {len(overrides)} overrides of {profile_path(args.profile)}", file=sys.stderr)
        return
    print(" ".join(f"-S {key}={flow(value)}" for key, value in overrides))


if __name__ == "__main__":
    main()
