"""The Markdown documents: every relative link points at a file or folder of the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "BENCHMARKS.md", "results/README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
    """The link targets of ``text`` that are paths (no scheme, no pure #anchor), without their #anchor."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


def test_relative_links_finds_paths_only():
    text = "[a](docs/a.md) [b](https://x.y/z) [c](#top) [d](../BENCHMARKS.md#decoding)\n```\n[e](nope.md)\n```"
    assert relative_links(text) == ["docs/a.md", "../BENCHMARKS.md"]


@pytest.mark.parametrize("doc", DOCS)
def test_no_broken_relative_links(doc):
    path = ROOT / doc
    broken = [t for t in relative_links(path.read_text()) if not (path.parent / t).exists()]
    assert not broken, f"{doc}: broken links {broken}"
