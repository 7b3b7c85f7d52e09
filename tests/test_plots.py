"""The evaluate stage's PNG plots."""

from kvpop.geometry import CacheLayout
from kvpop.plots import plot_memory_curve, plot_occupancy

PNG = b"\x89PNG\r\n\x1a\n"


def test_plot_memory_curve(tmp_path):
    curves = {"dense": [(0, 1.0), (64, 1.5), (128, 2.0)], "streaming_llm": [(0, 0.5), (64, 0.5), (128, 0.5)]}
    out = plot_memory_curve(curves, tmp_path / "sub" / "memory.png")
    assert out == tmp_path / "sub" / "memory.png"
    data = out.read_bytes()
    assert data.startswith(PNG) and 1_000 < len(data) < 500_000


def test_line_plot_takes_unsorted_single_and_empty_series(tmp_path):
    points = {
        "kvpop_mlp": [(512, 0.8), (128, 0.4), (256, 0.6)],  # unsorted
        "tova": [(256, 0.5)],  # a single point
        "h2o": [],  # nothing: skipped
    }
    out = plot_memory_curve(points, str(tmp_path / "mem.png"))
    assert out.read_bytes().startswith(PNG) and out.stat().st_size > 1_000
    assert plot_memory_curve({}, tmp_path / "empty.png").stat().st_size > 0


def test_keep_map_is_what_the_bounded_cache_holds(tiny_model):
    """The keep map (from the training forward's eviction times) against a reference twin: decode the
    trace token by token with the bounded cache and read which positions each layer and head stores."""
    import torch

    from kvpop.decode import enable, new_cache
    from kvpop.evaluate import keep_map
    from kvpop.policies import make_policy

    sinks, window, k = 2, 6, 5
    model = enable(tiny_model("llama"))
    torch.manual_seed(3)
    mlp = make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    for p in mlp.parameters():  # a scorer that ranks tokens differently per layer and head
        p.data.normal_()
    ids = torch.randint(0, 96, (1, 48), generator=torch.Generator().manual_seed(5))
    S = ids.shape[1]
    for policy in (make_policy("streaming_llm"), mlp, make_policy("dense")):
        got = keep_map(model, policy, ids, layout=CacheLayout.of(sinks=sinks, window=window, long_range=k))  # (L, Hk, S)
        if not policy.evicts:
            assert torch.equal(got, torch.ones(2, 2, S))
            continue
        last = torch.full((2, 2, S), -1)  # the last query at which each position was stored
        cache = new_cache(model, policy, layout=CacheLayout(sinks + window + k, sinks, window))
        with torch.no_grad():
            for t in range(S):
                model(input_ids=ids[:, t : t + 1], position_ids=torch.tensor([[t]]), past_key_values=cache)
                for i, layer in enumerate(cache.layers):
                    for h in range(2):
                        stored = layer.pos[0, h][layer.pos[0, h] >= 0]
                        last[i, h, stored] = t
        j = torch.arange(S)
        want = ((last + 1 - j).float() / (S - j).float()).clamp(0, 1)
        assert torch.allclose(got, want), policy.name
        assert got.min() < 0.5  # eviction happened
    assert not torch.equal(keep_map(model, mlp, ids, layout=CacheLayout.of(sinks=sinks, window=window, long_range=k))[0],
                           keep_map(model, mlp, ids, layout=CacheLayout.of(sinks=sinks, window=window, long_range=k))[1])  # layers differ


def test_plot_keep_map_and_shared_lines(tmp_path):
    import torch

    from kvpop.plots import plot_keep_map, shared_lines

    maps = {"dense": torch.ones(2, 3, 50), "kvpop_mlp": torch.rand(2, 3, 50)}
    out = plot_keep_map(maps, tmp_path / "keep.png", marks={"definitions": [3, 4, 5], "quotes": [40, 41]}, title="t")
    assert out.read_bytes().startswith(PNG) and out.stat().st_size > 5_000
    # identical curves (all bounded caches at one budget) share one line, named together
    curves = {n: [(64, 0.5), (0, 0.5)] for n in ("e", "b", "c", "d", "a")} | {"dense": [(0, 1.0), (64, 2.0)], "h2o": []}
    assert shared_lines(curves) == [(((0.0, 0.5), (64.0, 0.5)), ["a", "b", "c", "d", "e"]), (((0.0, 1.0), (64.0, 2.0)), ["dense"])]
    assert plot_memory_curve(curves, tmp_path / "m.png").stat().st_size > 1_000


def test_plot_occupancy(tmp_path):
    maps = {"dms": [[0.5, 0.9], [1.0, 0.2]], "dbtrimkv": [[2.5, 0.1], [0.9, 0.5]], "kvpop_mlp": [[1.0, 1.0], [1.0, 1.0]]}
    out = plot_occupancy(maps, tmp_path / "occ.png", title="budget 48")
    assert out.read_bytes().startswith(PNG) and out.stat().st_size > 1_000
