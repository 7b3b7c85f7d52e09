"""The policy registry: names, declared capabilities, construction, and adding a policy."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from kvpop import policies
from kvpop.config import FREE_POLICIES, TRAINED_POLICIES, parse_params
from kvpop.geometry import CacheLayout
from kvpop.policies import REGISTRY, Policy, make_policy, names, policy_class, resolve_policy

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(num_layers=2, num_kv_heads=2, head_dim=16)


def test_registry_holds_every_policy_once_under_its_own_name():
    assert list(REGISTRY) == [
        "dense", "streaming_llm", "tova", "h2o", "streaming_llm_plus", "kvpop_mlp", "kvpop_mlp_pool", "kvpop", "kvpop_pool", "dms", "trimkv", "trimkv_joint",
        "dbtrimkv", "oracle_target", "oracle_sources",
    ]
    for name, cls in REGISTRY.items():
        assert cls.name == name
        assert cls.__name__.lower() == name.replace("_", "")  # class names match policy names
        assert issubclass(cls, Policy)


def test_declared_capabilities():
    caps = {name: cls.capabilities() for name, cls in REGISTRY.items()}
    assert caps["dense"]["evicts"] is False and all(c["evicts"] for n, c in caps.items() if n != "dense")
    assert names(learned=True) == ("kvpop_mlp", "kvpop_mlp_pool", "kvpop", "kvpop_pool", "dms", "trimkv", "trimkv_joint", "dbtrimkv")
    assert names(trained=True) == (
        "streaming_llm_plus", "kvpop_mlp", "kvpop_mlp_pool", "kvpop", "kvpop_pool", "dms", "trimkv", "trimkv_joint", "dbtrimkv",
    )
    assert names(gated=True) == ("dms", "trimkv", "trimkv_joint", "dbtrimkv")
    assert names(decays=True) == ("trimkv", "trimkv_joint", "dbtrimkv")
    assert names(one_pool=True) == ("kvpop_mlp_pool", "kvpop_pool", "dbtrimkv")
    assert [n for n, cls in REGISTRY.items() if not cls.trains_model] == ["trimkv", "dbtrimkv"]
    assert names(needs_attention=True) == ("tova", "h2o")
    assert names(scores_on_exit=True) == ("kvpop",)
    assert names(layer_independent=True, evicts=True) == ("streaming_llm", "streaming_llm_plus", "oracle_sources")
    assert names(oracle=True) == ("oracle_target", "oracle_sources")
    for cls in REGISTRY.values():
        c = cls.capabilities()
        assert not (c["learned"] and not c["trained"])  # a learned scorer is trained with its student
        assert not (c["needs_attention"] and (c["trained"] or c["layer_independent"] or c["scores_on_exit"]))
        assert cls.chunked_prefill <= cls.scores_on_exit
        assert cls.gated <= cls.learned and not (c["gated"] and c["scores_on_exit"])
        assert not (c["decays"] and (c["needs_attention"] or c["scores_on_exit"] or c["layer_independent"]))
        assert c["one_pool"] <= c["trained"]  # registered in the pool: trained in it (dbtrimkv, kvpop_mlp_pool); else OnePool ranks it
        assert not (c["oracle"] and (c["trained"] or c["needs_attention"] or c["scores_on_exit"]))  # evaluation only
    with pytest.raises(ValueError, match="unknown capability 'fast'"):
        names(fast=True)


def test_declared_hooks_are_implemented():
    """Each capability's hooks are overridden; the others raise with the policy named."""
    for name in REGISTRY:
        p = make_policy(name, **SHAPE)
        k = torch.randn(1, 2, 6, 16)
        pos = torch.arange(6)[None]
        if p.needs_attention:
            assert p.slot_scores(torch.zeros(1, 2, 3), torch.rand(1, 2, 1, 3)).shape == (1, 2, 3)
            assert torch.equal(p.token_scores(0, k, k, pos), torch.zeros(1, 2, 6, dtype=torch.float64))
            with pytest.raises(NotImplementedError, match=f"policy '{name}' has no full-sequence pattern"):
                p.scores(0, k, k, pos)
            continue
        if p.oracle:  # scores only a trace it has seen (tests/test_oracle.py)
            with pytest.raises(RuntimeError, match="call fit_trace first"):
                p.scores(0, k, k, pos)
            continue
        with pytest.raises(NotImplementedError, match=f"policy '{name}' is not an oracle"):
            p.fit_trace(input_ids=pos, record={}, targets={})
        s = p.scores(0, k, k, pos, doc_ids=torch.zeros_like(pos), window=2)
        assert (s is None) == (not p.evicts)
        if s is not None:
            assert s.prio.shape == (1, 2, 6) and s.prio.dtype == torch.float64
            assert (s.r_hat is not None) == p.learned
        delayed = p.read_delay(8) is not None  # a static priority read d tokens late (kvpop_pool)
        if p.scores_on_exit or delayed:
            state = p.init_state(0, 1, "cpu")
            state = p.step(0, state, k[:, :, 0], k[:, :, 0])
            assert p.exit_scores(0, state, k[:, :, 0], k[:, :, 0], 0).shape == (1, 2)
        else:
            with pytest.raises(NotImplementedError, match=f"policy '{name}' keeps no recurrent state"):
                p.init_state(0, 1, "cpu")
        if delayed:
            prio, r0, read = p.score_stream(0, torch.zeros_like(pos), pos, window=8).feed(k, k)
            assert prio.dtype == torch.float64 and r0 == 0 and prio.shape == (1, 2, 6) and bool(read.all())  # the whole document: all read out
        else:
            with pytest.raises(NotImplementedError, match=f"policy '{name}' has no delayed static priority"):
                p.score_stream(0, torch.zeros_like(pos), pos, window=8)
        if not p.needs_attention and p.evicts:
            with pytest.raises(NotImplementedError, match="does not re-score from attention"):
                p.slot_scores(torch.zeros(1, 2, 3), torch.rand(1, 2, 1, 3))


def test_long_range_slots_per_policy():
    geo = dict(layout=CacheLayout(384, 4, 256), head_dim=64)
    for name in REGISTRY:
        p = make_policy(name, num_layers=2, num_kv_heads=2, head_dim=64)
        want = 124 - 3 if name in ("kvpop", "kvpop_pool") else 124  # the mLSTM state (273 numbers) takes ceil(273 / 128) = 3 slots
        assert p.long_range_slots(**geo) == want


def test_make_and_resolve():
    assert type(make_policy("kvpop_mlp", **SHAPE)) is policy_class("kvpop_mlp")
    with pytest.raises(ValueError, match=r"unknown policy 'nope'; known: dense, streaming_llm"):
        make_policy("nope")
    with pytest.raises(ValueError, match="is learned: make_policy needs num_layers"):
        make_policy("kvpop")
    mlp = make_policy("kvpop_mlp", **SHAPE)
    assert resolve_policy("kvpop_mlp", mlp) is mlp
    assert type(resolve_policy("tova")) is policy_class("tova")
    with pytest.raises(ValueError, match="needs an export folder trained with it"):
        resolve_policy("kvpop", mlp)


def test_config_reads_the_registry():
    assert TRAINED_POLICIES == names(trained=True) and FREE_POLICIES == names(trained=False)
    raw = {"train": {"policies": ["kvpop"]}, "evaluate": {"policies": ["h2o"]}}
    p = parse_params(raw)
    assert p.train.policies == ["kvpop"] and p.evaluate.policies == ["h2o"]
    assert parse_params({}).train.policies == list(TRAINED_POLICIES)


def test_the_readme_example_policy_plugs_in(monkeypatch, tiny_model):
    """The documented ten-line policy (docs/policies.md), registered, runs through the registry and both decode paths."""
    from kvpop.decode import generate

    readme = (ROOT / "docs" / "policies.md").read_text()
    code = re.search(r"```python\n(# src/kvpop/policies/key_norm\.py.*?)```", readme, re.S).group(1)
    assert len(code.strip().splitlines()) <= 12
    ns: dict = {}
    exec(compile(code, "docs/policies.md", "exec"), ns)
    KeyNorm = ns["KeyNorm"]
    monkeypatch.setitem(policies.REGISTRY, "key_norm", KeyNorm)
    assert "key_norm" in names(trained=False) and "key_norm" not in names(needs_attention=True)
    pol = make_policy("key_norm", **SHAPE)
    model = tiny_model("llama")

    class Tok:
        pad_token_id, eos_token_id = 0, 1

    ids = torch.randint(2, 90, (2, 30), generator=torch.Generator().manual_seed(0))
    kw = dict(layout=CacheLayout(14, 2, 6), max_new_tokens=10)
    a, sa = generate(model, Tok, pol, ids, path="engine", **kw)
    b, sb = generate(model, Tok, pol, ids, path="reference", **kw)
    assert sa.path == "engine" and sb.path == "reference" and torch.equal(a, b)


def _imports(path: Path) -> set[str]:
    """kvpop modules imported anywhere in a file (module level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvpop"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("kvpop"))
    return out


def test_no_import_cycle_in_the_library():
    src = ROOT / "src"
    modules = {}
    for f in (src / "kvpop").rglob("*.py"):
        parts = f.relative_to(src).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = f
    graph = {m: {i for i in _imports(f) if i in modules and i != m} for m, f in modules.items()}
    # a package's __init__ re-exports its submodules: an edge into a package means one into them, not a cycle
    for m in graph:
        graph[m] = {i for i in graph[m] if not m.startswith(i + ".")}
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in graph[m]:
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(n):], n]))
            if n not in state:
                visit(n, [*stack, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


@pytest.mark.parametrize(("shape", "counts"), [
    ((30, 3, 64), {"kvpop_mlp": 748_980, "kvpop": 589_320, "dms": 11_610, "trimkv": 748_890, "trimkv_joint": 748_890,
                    "dbtrimkv": 743_105}),
    ((36, 8, 128), {"kvpop_mlp": 4_756_032, "kvpop": 3_765_888, "dms": 74_016, "trimkv": 4_755_744, "trimkv_joint": 4_755_744,
                      "dbtrimkv": 4_737_089}),
])
def test_parameter_counts_in_the_readme(shape, counts):
    """The documented table of scorer and gate sizes (docs/policies.md; SmolLM2-135M, Qwen3-4B) is what make_policy builds."""
    readme = (ROOT / "docs" / "policies.md").read_text()
    for name, n in counts.items():
        p = make_policy(name, num_layers=shape[0], num_kv_heads=shape[1], head_dim=shape[2])
        assert sum(x.numel() for x in p.parameters()) == n, name
        assert f"{n:,}" in readme, (name, n)


@pytest.mark.parametrize("name", ["kvpop_mlp", "kvpop", "dms", "streaming_llm", "trimkv"])
def test_for_layer_views_score_as_their_layer(name):
    """``for_layer(i)`` called with layer 0 scores as the policy's layer i (static scores; the mLSTM's
    recurrent step and exit score), shares the policy's storage (an in-place update such as
    ``load_state_dict`` reaches the view) and leaves the policy as it was; rules without one-layer
    views say so (None)."""
    L, Hk, D = 3, 2, 8
    policy = make_policy(name, num_layers=L, num_kv_heads=Hk, head_dim=D, scorer_hidden=4)
    torch.manual_seed(0)
    for p in policy.parameters():
        torch.nn.init.normal_(p, std=0.5)
    views = [policy.for_layer(i) for i in range(L)]
    if name == "trimkv":
        assert views == [None] * L
        return
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    k, v = torch.randn(2, Hk, 5, D), torch.randn(2, Hk, 5, D)
    pos = torch.arange(300, 305).expand(2, 5)
    for i, view in enumerate(views):
        if policy.scores_on_exit:
            state = policy.init_state(i, 2, "cpu")
            for t in range(5):
                state, vstate = policy.step(i, state, k[:, :, t], v[:, :, t]), view.step(0, state, k[:, :, t], v[:, :, t])
                assert all(torch.equal(a, b) for a, b in zip(state, vstate, strict=True))
            assert torch.equal(view.exit_scores(0, state, k[:, :, 0], v[:, :, 0], 17), policy.exit_scores(i, state, k[:, :, 0], v[:, :, 0], 17))
        else:
            assert torch.equal(view.token_scores(0, k, v, pos), policy.token_scores(i, k, v, pos))
    if policy.learned:
        assert sum(p.numel() for p in views[0].parameters()) * L == sum(p.numel() for p in policy.parameters())
        policy.load_state_dict({n: t + 1 for n, t in before.items()})  # in place: the views see it
        for i, view in enumerate(views):
            if not policy.scores_on_exit:
                assert torch.equal(view.token_scores(0, k, v, pos), policy.token_scores(i, k, v, pos))
        policy.load_state_dict(before)
    assert all(torch.equal(t, before[n]) for n, t in policy.state_dict().items())
