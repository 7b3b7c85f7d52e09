"""The one budget rule (kvpop.geometry.check_budget) at its boundaries, through every entry point:
params.yaml, the command line, the cache layout, the mLSTM's slots and the decode caches."""

import math
from pathlib import Path

import pytest
import torch
import yaml

from kvpop.cli import UsageError
from kvpop.cli import check_budget as cli_check_budget
from kvpop.config import ParamsError, parse_params
from kvpop.geometry import CacheLayout, check_budget
from kvpop.mlstm import kvpop_k, state_numbers
from kvpop.policies import make_policy

ROOT = Path(__file__).resolve().parents[1]
SINKS, WINDOW = 2, 8
EDGE = SINKS + WINDOW  # budget == sinks + window: no long-range slot


@pytest.mark.parametrize(("budget", "ok"), [(EDGE - 1, False), (EDGE, False), (EDGE + 1, True)])
def test_the_pipeline_needs_one_long_range_slot(budget, ok):
    """Params, the command line and check_budget's default agree: budget > sinks + window."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw.update(budget=budget, sinks=SINKS, window=WINDOW)
    if ok:
        check_budget(budget, SINKS, WINDOW)
        assert parse_params(raw).layout == CacheLayout(budget, SINKS, WINDOW, 1)
        assert cli_check_budget(budget, SINKS, WINDOW).long_range == 1
        return
    with pytest.raises(ValueError, match=rf"budget \({budget}\) must be >= sinks \+ window \+ 1 = 2 \+ 8 \+ 1"):
        check_budget(budget, SINKS, WINDOW)
    with pytest.raises(ParamsError, match="budget") as err:
        parse_params(raw)
    assert all(key in str(err.value) for key in ("budget", "sinks", "window"))
    with pytest.raises(UsageError, match=f"--budget {budget} --sinks 2 --window 8: budget"):
        cli_check_budget(budget, SINKS, WINDOW)


@pytest.mark.parametrize(("budget", "ok"), [(EDGE - 1, False), (EDGE, True), (EDGE + 1, True)])
def test_a_layout_may_hold_sinks_and_window_alone(budget, ok):
    """CacheLayout checks the same rule with min_long_range=0: a cache that only decodes needs no long-range slot."""
    if ok:
        assert CacheLayout(budget, SINKS, WINDOW).long_range == budget - EDGE
        check_budget(budget, SINKS, WINDOW, min_long_range=0)
    else:
        with pytest.raises(ValueError, match=r"budget \(9\) must be >= sinks \+ window = 2 \+ 8"):
            CacheLayout(budget, SINKS, WINDOW)


@pytest.mark.parametrize(("sinks", "window"), [(-1, 8), (2, 0)])
def test_sinks_and_window_are_checked_first(sinks, window):
    with pytest.raises(ValueError, match="need window >= 1 and sinks >= 0"):
        CacheLayout(100, sinks, window)
    with pytest.raises(UsageError, match="--window"):
        cli_check_budget(100, sinks, window)


def test_layout_fields():
    g = CacheLayout(20, 2, 8)
    assert (g.long_range, g.slots, g.first_long_range) == (10, 20, 10)
    assert CacheLayout.of(sinks=2, window=8, long_range=3) == CacheLayout(13, 2, 8)
    with pytest.raises(ValueError, match="long_range must be >= 0"):
        CacheLayout(20, 2, 8, -1)
    assert g.nominal == g and CacheLayout(20, 2, 8, 4).nominal == g
    assert [g.home_slot(p) for p in (0, 1, 2, 9, 10, 11)] == [0, 1, 2, 9, 2, 3]


@pytest.mark.parametrize("head_dim", [16, 64])
def test_kvpop_k_needs_one_slot_besides_its_state(head_dim):
    """The mLSTM's state takes ceil(state / 2 head_dim) slots out of the budget; the same rule then
    needs one long-range slot more."""
    state = math.ceil(state_numbers(16, 16) / (2 * head_dim))
    assert kvpop_k(CacheLayout(EDGE + state + 1, SINKS, WINDOW), head_dim) == 1
    for budget in (EDGE + state, EDGE + state - 1):
        with pytest.raises(ValueError, match=f"state: the {state} slots of the recurrent state"):
            kvpop_k(CacheLayout(budget, SINKS, WINDOW), head_dim)


def test_for_policy_takes_the_policy_slots():
    shape = dict(num_layers=2, num_kv_heads=2, head_dim=16)
    nominal = CacheLayout(30, SINKS, WINDOW)
    assert nominal.for_policy(make_policy("kvpop_mlp", **shape), head_dim=16) == nominal
    kv = nominal.for_policy(make_policy("kvpop", **shape), head_dim=16)
    assert (kv.budget, kv.long_range) == (30, 20 - 9)  # the state (273 numbers) costs ceil(273 / 32) = 9 slots
    assert kv.nominal == nominal


def test_decode_caches_take_budget_equal_to_sinks_plus_window(tiny_model):
    """The reference cache and the engine decode with no long-range slot (sinks and ring alone)."""
    from kvpop.decode import BoundedCache, DecodeEngine

    model = tiny_model()
    pol = make_policy("streaming_llm", num_layers=2, num_kv_heads=2, head_dim=16)
    layout = CacheLayout(EDGE, SINKS, WINDOW)
    assert BoundedCache(model.config, pol, layout).slots == EDGE
    eng = DecodeEngine(model, pol, layout=layout, batch_size=1, chunk=128)
    assert (eng.long_range, eng.slots) == (0, EDGE)
    logits = eng.prefill(torch.randint(0, model.config.vocab_size, (1, 20)))
    assert torch.isfinite(logits).all()
