"""kvpop.benchmarking: the timers, the default result path, running a script in a fresh process, and
fill_cache against its twin (a real prefill of the same context)."""

from __future__ import annotations

import pytest
import torch

from kvpop.benchmarking import RESULTS, default_out, fill_cache, random_ids, run_script, time_calls
from kvpop.decode import enable
from kvpop.decode.engine import DecodeEngine
from kvpop.geometry import CacheLayout
from kvpop.policies import make_policy

SINKS, WINDOW, K = 4, 16, 12


def test_time_calls_counts_and_keeps_the_last_result():
    calls = []
    t = time_calls(lambda: calls.append(len(calls)) or len(calls), reps=3, warmup=2)
    assert len(calls) == 5 and t.out == 5 and len(t.seconds) == 3
    assert 0 <= t.best <= t.median
    with pytest.raises(ValueError, match="reps"):
        time_calls(lambda: None, reps=0)


def test_default_out_names_script_and_device():
    assert default_out("bench/kernels/bench_insert.py", cuda=False) == RESULTS / "bench_insert" / "cpu.json"
    assert default_out("/x/bench/bench_decode.py", small=True, cuda=False, suffix="policies") == RESULTS / "bench_decode" / "cpu_policies_small.json"


def test_run_script_is_a_fresh_process_with_src_on_the_path(tmp_path, monkeypatch):
    script = tmp_path / "s.py"
    script.write_text("import os, sys, kvpop.benchmarking as b\nprint(sys.argv[1:], os.environ.get('GONE'), os.environ.get('ADDED'))\n")
    monkeypatch.setenv("GONE", "here")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    proc = run_script(script, ["a", 2], env={"ADDED": "yes"}, drop_env=["GONE"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['a', '2'] None yes"


def held(eng: DecodeEngine) -> list[set[int]]:
    """The positions each (layer, row, KV head) holds."""
    return [set(p[b, h][p[b, h] >= 0].tolist()) for p in eng.pos for b in range(eng.B) for h in range(eng.Hk)]


@pytest.mark.parametrize("ctx", [10, 40, 100])
def test_fill_cache_holds_what_a_prefill_holds(tiny_model, ctx):
    """The sinks and the window are the positions a prefill of ``ctx`` tokens leaves; the long-range
    slots hold as many (random) older tokens; the cache has seen ``ctx`` tokens and steps on."""
    model = enable(tiny_model("qwen3"))
    policy = make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    kw = dict(layout=CacheLayout(SINKS + WINDOW + K, SINKS, WINDOW), batch_size=2, chunk=128)
    ref, eng = DecodeEngine(model, policy, **kw), DecodeEngine(model, policy, **kw)
    ref.prefill(random_ids(2, ctx, 96, 0, "cpu"))
    fill_cache(eng, ctx, seed=0)
    assert eng.seen == ref.seen == ctx
    fixed = set(range(min(ctx, SINKS))) | set(range(max(SINKS, ctx - WINDOW), ctx))
    for got, want in zip(held(eng), held(ref), strict=True):
        assert fixed <= got and fixed <= want and len(got) == len(want)
        assert all(SINKS <= p < ctx - WINDOW for p in got - fixed)
    assert torch.isfinite(eng.step()).all()


def test_op_count_counts_by_part_and_restores_what_it_wrapped():
    import torch

    from kvpop.benchmarking import OpCount

    class Thing:
        def inner(self, x):
            return (x + 1) * 2  # two operations

        def outer(self, x):
            return self.inner(x) - 1  # one more

    thing = Thing()
    counter = OpCount()
    counter.part(thing, "inner", "inner")  # an instance's shadow
    counter.part(Thing, "outer", "outer")  # a class's method, replaced
    x = torch.ones(3)
    with counter:
        thing.outer(x)
    assert dict(counter.counts) == {"inner": 2, "outer": 1}
    counter.restore()
    assert "inner" not in vars(thing) and Thing.outer.__qualname__.endswith("Thing.outer")
    with OpCount() as again:
        thing.outer(x)
    assert dict(again.counts) == {"other": 3}
