"""bench/kernels/compare_profiles.py: two profile_decode.py results side by side (no GPU: it reads files)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "kernels" / "compare_profiles.py"


def profile(path: Path, ms: float, kernels: list[tuple[str, float, float]]) -> Path:
    path.write_text(json.dumps({"what": "a profile", "ms_per_step": ms,
                                "kernels": [{"name": n, "us_per_step": us, "calls_per_step": c} for n, us, c in kernels]}))
    return path


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60)


def test_groups_per_layer_and_per_step_kernels_and_their_differences(tmp_path):
    a = profile(tmp_path / "bounded.json", 4.0, [("triton_tem_fused_flex_attention_0", 200.0, 4), ("nvjet_sm90_gemm", 3000.0, 8),
                                                  ("triton_poi_fused_add_0", 100.0, 4)])
    b = profile(tmp_path / "pooled.json", 5.0, [("triton_tem_fused_flex_attention_0", 450.0, 4), ("nvjet_sm90_gemm", 3000.0, 8),
                                                 ("at::native::mbtopk::computeDigitCumSum", 160.0, 16), ("triton_poi_fused_add_0", 100.0, 5)])
    out = run(a, b, "--layers", 4)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    wall = next(line for line in lines if line.startswith("ms per step"))
    assert "4.000" in wall and "5.000" in wall and "+1.000" in wall
    busy = next(line for line in lines if line.startswith("GPU busy"))
    assert "3.300" in busy and "3.710" in busy and "+0.410" in busy
    attn = next(line for line in lines if line.startswith("attention, per layer"))
    assert "+250.0" in attn
    topk = next(line for line in lines if line.startswith("topk / sort, per layer"))  # 16 calls: a multiple of 4 layers
    assert "+160.0" in topk and "+16" in topk
    fused = [line for line in lines if line.startswith("fused (triton)")]
    assert any("per step" in line and "+100.0" in line for line in fused)  # 5 calls: not a multiple of the layers
    assert lines.index(attn) < lines.index(topk)  # the largest difference first


def test_a_file_without_a_kernel_list_is_refused_by_name(tmp_path):
    good = profile(tmp_path / "good.json", 4.0, [("k", 1.0, 1)])
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps({"what": "an older profile", "ms_per_step": 4.0, "table": "..."}))
    out = run(good, bad)
    assert out.returncode != 0 and "old.json" in out.stderr and "kernels" in out.stderr
    for broken, why in ((tmp_path / "missing.json", "No such file"), (tmp_path / "torn.json", "cannot read")):
        if broken.name == "torn.json":
            broken.write_text('{"kernels": [')
        out = run(good, broken)
        assert out.returncode != 0 and broken.name in out.stderr and why in out.stderr and "Traceback" not in out.stderr
