"""Constrained sampling (serving/sampling.py with an `allowed` mask): only allowed tokens are
drawn, and the logprob reported is under the masked distribution actually sampled from."""

from __future__ import annotations

import torch

from serving.sampling import RowSampling, sample_rows


def test_masked_rows_sample_allowed_tokens_with_renormalized_logprobs() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    allowed = torch.zeros(50, dtype=torch.bool)
    allowed[[3, 7, 11]] = True
    forced = torch.zeros(50, dtype=torch.bool)
    forced[5] = True
    rows = [RowSampling(1.0, 1.0, torch.Generator().manual_seed(1), allowed),
            RowSampling(0.0, 1.0, torch.Generator().manual_seed(2), forced),
            RowSampling(0.7, 1.0, torch.Generator().manual_seed(3))]
    before = logits.clone()
    tokens, chosen, dists = sample_rows(logits, rows)
    assert torch.equal(logits, before)  # the caller's logits are not masked in place
    assert tokens[0] in (3, 7, 11)
    expected = torch.log_softmax(logits[0, [3, 7, 11]], dim=-1)
    assert abs(chosen[0] - float(expected[[3, 7, 11].index(tokens[0])])) < 1e-6
    assert tokens[1] == 5 and chosen[1] == 0.0  # forced: probability 1, greedy or not
    assert abs(chosen[2] - float(torch.log_softmax(logits[2] / 0.7, -1)[tokens[2]])) < 1e-6
    assert torch.isinf(dists[0][~allowed]).all()
