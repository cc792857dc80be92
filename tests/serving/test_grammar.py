"""Constrained sampling (serving/sampling.py with a grammar per row, serving/grammar.py): only
the tokens the grammar accepts are drawn, and the logprob reported is under the masked
distribution actually sampled from."""

from __future__ import annotations

import torch
import xgrammar

from serving.grammar import TokenGrammar, mask_rejected
from serving.sampling import RowSampling, sample_rows

VOCAB = ["<eos>", "a", "b", "c", "ab", "x", "y"]


def grammar(ebnf: str) -> TokenGrammar:
    info = xgrammar.TokenizerInfo(VOCAB, stop_token_ids=[0])
    compiled = xgrammar.GrammarCompiler(info).compile_grammar(ebnf)
    return TokenGrammar(xgrammar.GrammarMatcher(compiled))


def test_masked_rows_sample_allowed_tokens_with_renormalized_logprobs() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, len(VOCAB))
    starts_ab, forced_x = grammar('root ::= "a" "b"'), grammar('root ::= "x"')
    rows = [RowSampling(1.0, 1.0, torch.Generator().manual_seed(1), starts_ab),
            RowSampling(0.0, 1.0, torch.Generator().manual_seed(2), forced_x),
            RowSampling(0.7, 1.0, torch.Generator().manual_seed(3))]
    before = logits.clone()
    tokens, chosen, dists = sample_rows(logits, rows)
    assert torch.equal(logits, before)  # the caller's logits are not masked in place
    allowed = [1, 4]  # "a", "ab": the only starts of "ab"
    assert tokens[0] in allowed
    expected = torch.log_softmax(logits[0, allowed], dim=-1)
    assert abs(chosen[0] - float(expected[allowed.index(tokens[0])])) < 1e-6
    assert tokens[1] == 5 and chosen[1] == 0.0  # forced: probability 1, greedy or not
    assert abs(chosen[2] - float(torch.log_softmax(logits[2] / 0.7, -1)[tokens[2]])) < 1e-6
    rejected = [i for i in range(len(VOCAB)) if i not in allowed]
    assert torch.isinf(dists[0][rejected]).all() and torch.isfinite(dists[2]).all()


def test_the_mask_follows_each_grammar_and_allows_the_stop_token_where_it_is_complete(
        ) -> None:
    g = grammar('root ::= "a" "b"')
    logits = torch.zeros(2, len(VOCAB))
    masked = mask_rejected(logits, [None, g])
    assert torch.equal(masked[0], logits[0])
    assert torch.isfinite(masked[1]).tolist() == [False, True, False, False, True, False, False]
    g.accept(1)  # "a": "b" must follow
    assert torch.isfinite(mask_rejected(logits, [g])[0]).nonzero().flatten().tolist() == [2]
    g.accept(2)  # complete: only the stop token
    assert torch.isfinite(mask_rejected(logits, [g])[0]).nonzero().flatten().tolist() == [0]
    g.accept(0)
    assert g.done
    assert mask_rejected(logits, [None, None]) is logits  # no grammar: no copy
