"""kvpop_pool: the delayed mLSTM scorer under one pool (kvpop.policies.kvpop_pool), against its twins.

The mLSTM stream over chunks (kvpop.mlstm.ChunkwiseStream) against the chunkwise form over whole rows;
a score reads tokens up to j + delay and no further; the chunked pool forward (chunks of window -
delay) against the fixed point (times exactly, logits) and token-by-token decoding with
OnePoolCache (logits), for delays 0, window / 2 and window - 1; packed rows; the training forward
under the chunked times (its recorded priorities give those times back), its one pool loss and its
gradients; a short training, export and evaluation; and the delay's validation.
"""

import pytest
import torch

from kvpop.attention import ScorerTraining, SparseContext
from kvpop.decode import enable, new_cache, teacher_forced_logits
from kvpop.evaluate import pool_fixed_point
from kvpop.geometry import CacheLayout
from kvpop.mlstm import ChunkwiseStream, HeadwiseMLSTM, readout_times
from kvpop.policies import make_policy
from kvpop.pool import pool_chunked
from kvpop.selection import global_eviction_times

from conftest import packed_toy

SINKS, WINDOW, K = 2, 8, 5
DIMS = dict(num_layers=2, num_kv_heads=2, head_dim=16, scorer_dk=4, scorer_dv=4)  # state: 21 numbers, one slot at head dim 16
NOMINAL = CacheLayout(SINKS + WINDOW + K + 1, SINKS, WINDOW)  # nominal budget: K long-range slots beside the state's one
LAYOUT = CacheLayout(NOMINAL.budget, SINKS, WINDOW, K)  # what the policy runs with (NOMINAL.for_policy)
DELAYS = [0, WINDOW // 2, WINDOW - 1]  # chunks of 8, 4 and 1


@pytest.fixture(scope="module")
def llama(tiny_model):
    return enable(tiny_model("llama"))


def mlstm_pool(delay=None, seed=0):
    """A kvpop_pool on the tiny llama whose gates and memory read-out depend on the tokens."""
    torch.manual_seed(seed)
    policy = make_policy("kvpop_pool", **DIMS, scorer_delay=delay)
    with torch.no_grad():
        for cell in policy.scorer.layers:
            cell.w_gate.normal_(std=0.3)
            cell.w_o.mul_(3.0)
    return policy


def test_the_layout_holds_k_slots_beside_the_state():
    assert NOMINAL.for_policy(mlstm_pool(), head_dim=16) == LAYOUT


# --- the mLSTM stream ----------------------------------------------------------------------------------
@pytest.mark.parametrize("delay", [None, 5])
@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_the_stream_is_the_chunkwise_form(chunk, delay):
    """Fed in chunks, on packed rows (documents that start inside a chunk, padding): every token is read
    out exactly once, with the chunkwise form's score over the whole row; the readers' range either the union
    over the rows (from the host) or, with the delay given, the chunk's own ``[c0 - d, c1)`` (no host sync)."""
    torch.manual_seed(1)
    cell = HeadwiseMLSTM(2, 16, d_k=4, d_v=4).double()  # float64: the two forms agree to rounding, not float32's carry over 50 chunks
    with torch.no_grad():
        cell.w_gate.normal_(std=0.3)
    _, doc, _ = packed_toy(2, 50, seed=2)
    k, v = torch.randn(2, 2, 50, 16, dtype=torch.float64), torch.randn(2, 2, 50, 16, dtype=torch.float64)
    start, tau = readout_times(doc, 2, 50, 5)
    with torch.no_grad():
        want = cell.chunkwise(k, v, start, tau, chunk=16)  # (B, Hk, S)
        stream, got, reads = ChunkwiseStream(cell, start, tau, delay=delay), torch.zeros_like(want), torch.zeros(2, 50, dtype=torch.long)
        assert (stream.tau_host is None) == (delay is not None)
        for c in range(0, 50, chunk):
            r_hat, r0, read = stream.feed(k[:, :, c : c + chunk], v[:, :, c : c + chunk])
            R = r_hat.shape[-1]
            if delay is not None:
                assert (r0, R) == (max(0, c - delay), min(c + chunk, 50) - max(0, c - delay))
            assert bool((((tau[:, r0 : r0 + R] >= c) & (tau[:, r0 : r0 + R] < c + chunk)) == read).all())
            got[:, :, r0 : r0 + R] += torch.where(read[:, None], r_hat, 0.0)
            reads[:, r0 : r0 + R] += read.long()
    assert bool((reads == 1).all())
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_a_score_reads_up_to_its_delay_and_no_further():
    policy = mlstm_pool(delay=3)
    k, v = torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16)
    pos = torch.arange(30)[None]
    with torch.no_grad():
        base = policy.scores(0, k, v, pos, doc_ids=torch.zeros_like(pos), window=WINDOW).prio  # (1, Hk, S)
        for t in (10, 20):
            k2 = k.clone()
            k2[:, :, t] += 1.0
            moved = policy.scores(0, k2, v, pos, doc_ids=torch.zeros_like(pos), window=WINDOW).prio
            assert torch.equal(moved[..., : t - 3], base[..., : t - 3])  # j + 3 < t: blind to token t, bitwise
            assert bool((moved[..., t - 3] != base[..., t - 3]).all())  # j + 3 = t: reads it


# --- the chunked forward against the fixed point and decoding --------------------------------------------
# chunk None: window - delay (8, 4, 1); 3: chunks that do not divide the row
@pytest.mark.parametrize(("delay", "chunk"), [(0, None), (0, 3), (4, None), (4, 3), (7, None)])
def test_the_chunked_forward_is_the_fixed_point(llama, delay, chunk):
    policy = mlstm_pool(delay, seed=3)
    ids = torch.randint(0, 96, (2, 60), generator=torch.Generator().manual_seed(4))
    want, want_logits = pool_fixed_point(llama, policy, ids, layout=LAYOUT, keep_logits=True)
    got, logits = pool_chunked(llama, policy, ids, layout=LAYOUT, chunk=chunk, keep_logits=True)
    assert torch.equal(got, want.long())
    assert (logits - want_logits).abs().max() < 1e-4
    held = (got > 59).sum(-1)  # (L, B, Hk) entries attendable by the last query
    assert bool((held.sum((0, 2)) == 2 * 2 * LAYOUT.slots).all()) and int(held.max()) > LAYOUT.slots  # full, split unevenly


@pytest.mark.parametrize("delay", DELAYS)
def test_the_chunked_forward_is_decoding(llama, delay):
    """OnePoolCache: the state reads every token as it enters, token p - delay is read out at step p."""
    policy = mlstm_pool(delay, seed=5)
    S = 56
    ids = torch.randint(0, 96, (2, S), generator=torch.Generator().manual_seed(6))
    evict, logits = pool_chunked(llama, policy, ids, layout=LAYOUT, keep_logits=True)
    cache = new_cache(llama, policy, NOMINAL)
    decoded = teacher_forced_logits(llama, policy, ids, layout=NOMINAL, prefill=LAYOUT.slots, cache=cache)
    assert (decoded - logits).abs().max() < 1e-4
    assert bool((cache.pool_pos >= 0).all()) and bool(torch.isfinite(cache.pool_lb).all())  # a full pool, every entry scored
    for b in range(2):  # the pool holds exactly the (pair, token) entries past the window that the last query attends
        held = {(int(f), int(j)) for f, j in zip(cache.pool_f[b], cache.pool_pos[b], strict=True)}
        alive = (evict[:, b, :, SINKS : S - WINDOW] > S - 1).nonzero().tolist()  # (layer, head, j - sinks)
        assert held == {(layer * 2 + h, j + SINKS) for layer, h, j in alive}


def test_a_prompt_of_the_budget_is_decoded_as_the_chunked_forward(llama):
    """The longest prompt the pool cache takes at once is the policy's slots (its nominal budget holds the state's)."""
    policy = mlstm_pool(seed=7)
    cache = new_cache(llama, policy, NOMINAL)
    assert cache.max_prefill == LAYOUT.slots < NOMINAL.budget


@pytest.mark.parametrize("path", ["engine", "reference"])
def test_greedy_generation_is_the_chunked_forwards_argmax(llama, path):
    """kvpop.decode.generate runs kvpop_pool on the pooled engine (each layer's mLSTM state read out at j + d;
    prefill chunks of window - d; twins: tests/test_pooled.py) and on the reference path (OnePoolCache, the prompt
    past its slots fed one token at a time): each greedy token is the argmax of the chunked forward's logits over
    the generated text (a path check: the tiny model's argmax hardly depends on the pattern; the decoding twins
    check it)."""
    from kvpop.decode import engine_refusal, generate

    class Tok:
        pad_token_id, eos_token_id = 0, llama.generation_config.eos_token_id

    policy = mlstm_pool(seed=15)
    prompt = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(16))
    assert engine_refusal(llama, policy) is None
    new, stats = generate(llama, Tok(), policy, prompt, layout=NOMINAL, max_new_tokens=16, path=path)
    assert stats.path == path and new.shape == (1, 16)
    full = torch.cat([prompt, new], 1)
    _, logits = pool_chunked(llama, policy, full, layout=LAYOUT, keep_logits=True)
    want = logits[0, 29:-1].argmax(-1)  # (16,) the prediction after each prefix
    stop = [i for i, t in enumerate(new[0].tolist()) if t == Tok.eos_token_id]
    n = stop[0] + 1 if stop else 16  # after an end-of-sequence token: padding
    assert torch.equal(new[0, :n], want[:n]) and n > 8


@pytest.mark.parametrize("delay", [0, WINDOW // 2])
def test_packed_rows_start_each_document_afresh(llama, delay):
    """Two documents packed in one row: each gets the times and logits it gets alone."""
    policy = mlstm_pool(delay, seed=8)
    a = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(9))
    b = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(10))
    doc = torch.tensor([[0] * 40 + [1] * 30])
    pos = torch.cat([torch.arange(40), torch.arange(30)])[None]
    got, logits = pool_chunked(llama, policy, torch.cat([a, b], 1), layout=LAYOUT, doc_ids=doc, pos=pos, keep_logits=True)
    ea, la = pool_chunked(llama, policy, a, layout=LAYOUT, keep_logits=True)
    eb, lb = pool_chunked(llama, policy, b, layout=LAYOUT, keep_logits=True)
    assert torch.equal(torch.where(ea >= 40, -1, ea), torch.where(got[..., :40] >= 40, -1, got[..., :40]))
    assert torch.equal(torch.where(eb >= 30, -1, eb), torch.where(got[..., 40:] >= 70, -1, got[..., 40:] - 40))
    assert (logits[:, :40] - la).abs().max() < 1e-4 and (logits[:, 40:] - lb).abs().max() < 1e-4
    assert (ea < 40).any() and (eb < 30).any()


def test_the_training_forward_ranks_what_the_chunked_forward_ranked(llama):
    """On packed rows: the differentiable forward under the chunked times (as training runs it) scores every
    token with the chunkwise form over whole rows; those priorities give the same times back, and the logits agree."""
    policy = mlstm_pool(seed=11)
    ids, doc, pos = packed_toy(2, 64, seed=12)
    evict, want = pool_chunked(llama, policy, ids, layout=LAYOUT, doc_ids=doc, pos=pos, keep_logits=True)
    ctx = SparseContext.for_rows(policy, doc, pos, LAYOUT, global_evict=evict)
    with torch.no_grad():
        logits = llama(input_ids=ids, position_ids=pos, kvpop_ctx=ctx).logits
    prio = torch.stack([ctx.global_prio[i] for i in sorted(ctx.global_prio)])  # (L, B, Hk, S)
    again = global_eviction_times(prio, doc, pos, sinks=SINKS, window=WINDOW, long_range=K)
    assert torch.equal(again.long(), evict) and bool((evict < 64).any())
    assert (logits - want).abs()[doc >= 0].max() < 1e-4  # padding: no document, nothing to compare


def test_it_refuses_a_chunk_longer_than_window_minus_delay_and_an_impossible_delay(llama):
    ids = torch.zeros(1, 20, dtype=torch.long)
    with pytest.raises(ValueError, match=r"chunk 5 must be in \[1, window - delay = 8 - 4 = 4\]"):
        pool_chunked(llama, mlstm_pool(4), ids, layout=LAYOUT, chunk=5)
    with pytest.raises(ValueError, match=r"delay 8 is not in \[0, window - 1 = 7\] \(window 8\)"):
        pool_chunked(llama, mlstm_pool(8), ids, layout=LAYOUT)
    with pytest.raises(ValueError, match="delay must be an int >= 0"):
        mlstm_pool(-1)
    assert mlstm_pool().read_delay(WINDOW) == WINDOW // 4 and mlstm_pool(0).read_delay(WINDOW) == 0


def test_the_delay_is_a_validated_param():
    from kvpop.config import ParamsError, parse_params

    assert parse_params({"window": 8, "budget": 20, "train": {"scorer_delay": 7}}).train.scorer_delay == 7
    assert parse_params({}).train.scorer_delay is None  # window // 4
    for bad in (8, 12, -1):
        with pytest.raises(ParamsError, match=rf"train.scorer_delay {bad} is not in \[0, window - 1 = 7\] \(window 8\)"):
            parse_params({"window": 8, "budget": 20, "train": {"scorer_delay": bad}})
    with pytest.raises(ParamsError, match=r"\['scorer_delay'\] cannot differ per policy"):
        parse_params({"train": {"per_policy": {"kvpop_pool": {"scorer_delay": 3}}}})


# --- training -------------------------------------------------------------------------------------------
def test_training_runs_under_the_pools_pattern_with_one_loss_for_the_model(llama):
    """The boundary labels of the mLSTM in the pool: one loss for the model, one decision per (pair, leaver)
    once the pool is full, each against its model-wide competitor; the loss reaches every mLSTM weight and
    the decay of every layer, not the model."""
    from kvpop.boundary import pool_boundary_labels

    policy = mlstm_pool(seed=13)
    ids = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(14))
    pos = torch.arange(48).expand(2, 48)
    doc = torch.zeros_like(pos)
    evict, _ = pool_chunked(llama, policy, ids, layout=LAYOUT)
    ctx = SparseContext.for_rows(policy, doc, pos, LAYOUT, scorer_training=ScorerTraining(weighting="uniform"), global_evict=evict)
    llama(input_ids=ids, position_ids=pos, kvpop_ctx=ctx)
    losses = ctx.finish_scorer_losses()
    assert len(losses) == 1 and ctx.scored_layers == 2 and torch.isfinite(losses[0])
    labels = pool_boundary_labels(torch.randn(2, 4, 48, dtype=torch.float64), doc, pos, layout=LAYOUT)  # the count: the geometry's
    assert float(ctx.stats[0]["decisions"]) == labels.y.numel() > 0
    losses[0].backward()
    for cell in policy.scorer.layers:
        for name in ("w_q", "w_k", "w_v", "w_gate", "w_o", "w_p", "b"):
            g = getattr(cell, name).grad
            assert g is not None and g.abs().sum() > 0, name
    assert policy.scorer.decay.logit.grad is not None and bool((policy.scorer.decay.logit.grad != 0).all())
    assert all(p.grad is None for p in llama.parameters())


def test_a_short_training_exports_loads_and_evaluates(tiny_tokenizer, tmp_path):
    """build_training on the tiny fixtures: two steps (finite losses, the scorer moves), the export keeps the
    delay and loads without the trainer, and the evaluation scores it through the chunked pool forward."""
    import copy

    from kvpop.config import TrainConfig
    from kvpop.evaluate import Candidate, evaluate_fidelity
    from kvpop.export import export, load_export, read_meta
    from kvpop.train import PackedDataset, build_training
    from test_train import tiny_pair

    teacher, _ = tiny_pair()
    ids, doc, pos = packed_toy(4, 64)
    cfg = TrainConfig(steps=2, batch_size=2, top_logits=16, model_lr=1e-3, scorer_delay=3, target="max", boundary_weight="uniform",
                      precision="32-true", accelerator="cpu")
    training = build_training(teacher, "kvpop_pool", PackedDataset(ids, doc, pos, (doc >= 0).long()), cfg=cfg, layout=NOMINAL, seed=0,
                              policy_kw={"scorer_dk": 4, "scorer_dv": 4})
    assert training.long_range == K and training.policy.read_delay(WINDOW) == 3
    before = copy.deepcopy(training.policy.state_dict())
    trainer = training.fit(enable_progress_bar=False, default_root_dir=tmp_path)
    m = trainer.callback_metrics
    assert trainer.global_step == 2 and torch.isfinite(m["train/kl"]) and torch.isfinite(m["train/score_loss"]) and m["train/decisions"] > 0
    assert any(not torch.equal(before[k], v) for k, v in training.policy.state_dict().items())
    out = tmp_path / "export"
    export(training.student, tiny_tokenizer, training.policy, out, layout=NOMINAL)
    assert read_meta(out)["scorer"]["delay"] == 3
    model, _, policy, _ = load_export(out)
    assert policy.name == "kvpop_pool" and policy.read_delay(WINDOW) == 3
    assert all(torch.equal(a, b) for a, b in zip(training.policy.state_dict().values(), policy.state_dict().values(), strict=True))
    records = [{"input_ids": torch.randint(2, 96, (60,), generator=torch.Generator().manual_seed(n)).tolist(), "loss_mask": [0] * 10 + [1] * 50}
               for n in range(2)]
    res = evaluate_fidelity(records, teacher, [Candidate("kvpop_pool", enable(model), policy)], layout=NOMINAL)["kvpop_pool"]
    assert res["traces"] == 2 and 0 < res["kl"] < 10 and res["occupancy"] == pytest.approx(1.0)
    occ = torch.tensor(res["occupancy_map"])
    assert occ.shape == (2, 2) and occ.max() > 1.0  # the pool moved slots between heads
