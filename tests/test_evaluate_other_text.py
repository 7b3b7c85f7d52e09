"""kvpop.evaluate.evaluate_other_text and evaluate.other_text: held-out code and prose scored against
the base model's dense attention, on the tiny fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpop.attention import register
from kvpop.config import ParamsError, parse_params
from kvpop.data.other_text import HELD_OUT_CODE, code_documents, held_out_records, token_ids
from kvpop.evaluate import Candidate, evaluate_other_text
from kvpop.geometry import CacheLayout
from kvpop.policies import make_policy

GEO = dict(layout=CacheLayout(20, 2, 8))  # k = 10 long-range slots; pieces of 48..96 tokens


@pytest.fixture(scope="module")
def scored(tiny_tokenizer):
    from conftest import build_tiny_model

    model = build_tiny_model(attn_implementation=register(), vocab_size=len(tiny_tokenizer))
    pieces = {kind: held_out_records(token_ids(tiny_tokenizer), kind, n, max_tokens=96) for kind, n in (("code", 2), ("prose", 1))}
    # h2o first: its token-by-token decoding switches the shared model to the cache attention
    cands = [Candidate("h2o", model, make_policy("h2o"), max_traces=1), Candidate("dense", model, make_policy("dense")),
             Candidate("streaming_llm", model, make_policy("streaming_llm")), Candidate("oracle_target", model, make_policy("oracle_target")),
             Candidate("oracle_sources", model, make_policy("oracle_sources"))]  # no quote sources in other text: no row
    return pieces, evaluate_other_text(pieces, model, cands, **GEO)


def test_pieces_are_held_out_and_at_most_the_row_length(scored):
    pieces, _ = scored
    assert [len(pieces["code"]), len(pieces["prose"])] == [2, 1]
    for recs in pieces.values():
        assert all(48 <= len(r["input_ids"]) <= 96 and r["loss_mask"] == [1] * len(r["input_ids"]) for r in recs)
    assert Path(pieces["code"][0]["source"]).name == HELD_OUT_CODE[0]
    assert pieces["prose"][0]["source"].endswith("METADATA")
    trained_on = {name for name, _ in code_documents()}
    assert not {r["source"] for recs in pieces.values() for r in recs} & trained_on


def test_dense_is_exact_and_a_bounded_policy_is_not(scored):
    pieces, res = scored
    assert set(res) == {"code", "prose"}
    for kind, by_policy in res.items():
        assert set(by_policy) == {"dense", "streaming_llm", "h2o", "oracle_target"}, kind  # the target's ceiling on that text
        for m in by_policy.values():
            assert set(m) == {"kl", "top1_agreement", "pieces"}
        assert by_policy["dense"]["kl"] == pytest.approx(0.0, abs=1e-6) and by_policy["dense"]["top1_agreement"] == 1.0
        assert len(pieces[kind][0]["input_ids"]) > GEO["layout"].budget and by_policy["streaming_llm"]["kl"] > 1e-6
        assert by_policy["h2o"]["kl"] > 1e-6
        assert by_policy["dense"]["pieces"] == len(pieces[kind]) and by_policy["h2o"]["pieces"] == 1  # decode-only: max_traces
        assert by_policy["oracle_target"]["pieces"] == len(pieces[kind]) and by_policy["oracle_target"]["kl"] > 1e-6  # it evicts too


def test_an_empty_kind_is_left_out(tiny_model):
    model = tiny_model(attn_implementation=register())
    ids = torch.randint(0, model.config.vocab_size, (30,)).tolist()
    res = evaluate_other_text({"code": [{"input_ids": ids, "loss_mask": [1] * 30}], "prose": []}, model,
                              [Candidate("dense", model, make_policy("dense"))], **GEO)
    assert set(res) == {"code"} and res["code"]["dense"]["pieces"] == 1


def test_params_key_is_validated():
    assert parse_params({}).evaluate.other_text.model_dump() == {"code": 0, "prose": 0}  # off by default
    assert parse_params({"evaluate": {"other_text": {"code": 2, "prose": 1}}}).evaluate.other_text.code == 2
    with pytest.raises(ParamsError, match=r"evaluate\.other_text\.code"):
        parse_params({"evaluate": {"other_text": {"code": -1}}})
    with pytest.raises(ParamsError, match=r"evaluate\.other_text\.poetry: unknown key"):
        parse_params({"evaluate": {"other_text": {"poetry": 1}}})


def test_held_out_records_check_their_arguments():
    with pytest.raises(ValueError, match="kind 'poetry'"):
        held_out_records(lambda t: list(t.encode()), "poetry", 1, max_tokens=10)
    with pytest.raises(ValueError, match="min_tokens <= max_tokens"):
        held_out_records(lambda t: list(t.encode()), "code", 1, max_tokens=10, min_tokens=20)
    assert held_out_records(lambda t: list(t.encode()), "code", 0, max_tokens=10) == []
