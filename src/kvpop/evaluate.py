"""Teacher-forced fidelity of eviction policies against the dense teacher.

For every held-out trace (one per row, unpacked) and every policy, the model runs under the
policy's pattern at the run's budget and is compared with the dense teacher on the same text:

* ``kl``: mean over scored positions of KL(p_dense || p_policy), full vocabulary;
* ``top1_agreement``: how often the argmax tokens agree;
* ``quote_accuracy``: top-1 accuracy on the recorded long-range quote tokens (the digits a later
  step copies from a definition many hundreds of tokens back).

Scored positions are the next-token predictions of assistant tokens (the trace's loss mask).

Oracle policies (``oracle_target``, ``oracle_sources``: ceilings that read the trace's future) see
each trace first (:meth:`kvpop.policies.Policy.fit_trace`); ``oracle_target`` ranks by the dense
teacher's own training target on the trace (:func:`kvpop.policies.oracle.teacher_targets`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvpop.attention import SparseContext
from kvpop.modeling import model_shape
from kvpop.policies import Dense, Policy


@dataclass
class Candidate:
    """A policy with the model it runs on.

    A policy with a full-sequence pattern runs one masked forward per trace (fast); rules that
    exist only at decode time (``needs_attention``: TOVA, H2O) are scored by teacher-forced
    decoding through the reference cache.
    """

    name: str
    model: object
    policy: Policy
    max_traces: int | None = None  # score only the first records (token-by-token decoding is slow)


@dataclass
class _Acc:
    kl: float = 0.0
    agree: int = 0
    tokens: int = 0
    quote_hit: int = 0
    quotes: int = 0

    traces: int = 0

    def result(self) -> dict[str, float]:
        return {
            "traces": self.traces,
            "tokens": self.tokens,
            "kl": self.kl / max(1, self.tokens),
            "top1_agreement": self.agree / max(1, self.tokens),
            "quote_accuracy": self.quote_hit / max(1, self.quotes),
        }


@torch.no_grad()
def forward_logits(model, policy: Policy, input_ids: Tensor, *, sinks: int, window: int, long_range: int) -> Tensor:
    """One trace (1, S) under a policy -> logits (S, V) float32."""
    S = input_ids.shape[1]
    pos = torch.arange(S, device=input_ids.device)[None]
    doc = torch.zeros_like(pos)
    ctx = SparseContext.for_rows(policy, doc, pos, sinks=sinks, window=window, long_range=long_range, executor="flex" if input_ids.is_cuda else "sdpa")
    return model(input_ids=input_ids, position_ids=pos, kvpop_ctx=ctx).logits[0].float()


def score_positions(record: dict) -> tuple[Tensor, Tensor]:
    """Prediction positions i (predicting token i + 1) of assistant tokens, and of quote tokens."""
    lm = torch.tensor(record["loss_mask"])
    scored = (lm[1:] > 0).nonzero().squeeze(-1)  # predicts token i + 1
    quotes = torch.tensor([q - 1 for q in record.get("quote_positions", []) if q >= 1], dtype=torch.long)
    return scored, quotes


@torch.no_grad()
def evaluate_fidelity(
    records: Sequence[dict],
    teacher,
    candidates: Iterable[Candidate],
    *,
    budget: int,
    sinks: int,
    window: int,
    device: str | torch.device = "cpu",
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, dict[str, float]]:
    """Per-policy fidelity metrics over the records at one nominal budget (see module docstring).

    A policy that scored no trace (an oracle whose input no record has) is left out of the result."""
    candidates = list(candidates)
    slots = {
        c.name: c.policy.long_range_slots(budget=budget, sinks=sinks, window=window, head_dim=model_shape(c.model)["head_dim"])
        for c in candidates
        if not c.policy.needs_attention
    }
    acc = {c.name: _Acc() for c in candidates}
    dense = Dense()
    for n, rec in enumerate(records):
        ids = torch.tensor(rec["input_ids"], device=device)[None]
        scored, quotes = score_positions(rec)
        scored, quotes = scored.to(device), quotes.to(device)
        ref = forward_logits(teacher, dense, ids, sinks=sinks, window=window, long_range=budget)  # (S, V)
        ref_logp = torch.log_softmax(ref, -1)
        ref_top = ref.argmax(-1)
        targets = ids[0, 1:]
        for c in candidates:
            if c.max_traces is not None and n >= c.max_traces:
                continue
            if c.policy.oracle and not c.policy.fit_trace(model=c.model, input_ids=ids, record=rec, sinks=sinks, window=window):
                continue  # the trace lacks what this oracle reads (e.g. no recorded quote sources)
            acc[c.name].traces += 1
            if c.policy.needs_attention:
                from kvpop.decode import teacher_forced_logits

                prefill = min(budget, ids.shape[1])  # nothing is evicted before the cache is full
                logits = teacher_forced_logits(c.model, c.policy, ids, budget=budget, sinks=sinks, window=window, prefill=prefill)[0].float()
            elif c.policy.name == "dense" and c.model is teacher:
                logits = ref
            else:
                logits = forward_logits(c.model, c.policy, ids, sinks=sinks, window=window, long_range=slots[c.name])
            logp = torch.log_softmax(logits, -1)
            kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)  # (S,)
            a = acc[c.name]
            a.kl += kl[scored].sum().item()
            a.agree += (logits.argmax(-1)[scored] == ref_top[scored]).sum().item()
            a.tokens += scored.numel()
            if quotes.numel():
                a.quote_hit += (logits.argmax(-1)[quotes] == targets[quotes]).sum().item()
                a.quotes += quotes.numel()
        if progress:
            progress(n + 1, len(records))
    # an oracle that no trace could serve (e.g. oracle_sources without recorded sources) reports nothing
    return {name: a.result() for name, a in acc.items() if a.traces}
