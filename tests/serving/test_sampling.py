"""Batched sampling (serving/sampling.py): one call per decode step, each row on its own seed."""

from __future__ import annotations

import torch

from serving.sampling import RowSampling, sample_rows


def row(seed: int, temperature: float = 0.8, top_p: float = 1.0) -> RowSampling:
    return RowSampling(temperature, top_p, torch.Generator().manual_seed(seed))


def test_a_row_samples_the_same_whatever_its_batch() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    alone = [sample_rows(logits[b:b + 1], [row(b)]) for b in range(6)]
    tokens, logprobs, dists = sample_rows(logits, [row(b) for b in range(6)])
    assert tokens == [t[0] for t, _, _ in alone]
    assert logprobs == [lp[0] for _, lp, _ in alone]  # bitwise
    assert torch.equal(dists, torch.cat([d for _, _, d in alone]))


def test_greedy_nucleus_and_temperature_rows_in_one_batch() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0], [2.0, 0.0, 1.9]])
    tokens, logprobs, dists = sample_rows(logits, [row(0, temperature=0.0),
                                                   row(1, top_p=1e-9), row(2, temperature=2.0)])
    assert tokens[:2] == [1, 1]  # greedy; a vanishing nucleus holds only the top token
    assert logprobs[0] == torch.log_softmax(logits[0], -1)[1].item()  # raw, for greedy
    assert torch.allclose(dists[2], torch.log_softmax(logits[2] / 2.0, -1))
    assert logprobs[2] == dists[2, tokens[2]].item()  # the logprob it was drawn under


def test_draws_follow_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]]))
    counts = torch.zeros(3)
    for seed in range(3000):
        tokens, _, _ = sample_rows(logits, [row(seed, temperature=1.0)])
        counts[tokens[0]] += 1
    assert torch.allclose(counts / counts.sum(), torch.tensor([0.1, 0.6, 0.3]), atol=0.03)


def test_nucleus_excludes_the_tail() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {sample_rows(logits, [row(seed, temperature=1.0, top_p=0.7)])[0][0]
            for seed in range(300)}
    assert seen == {0, 1}  # 0.5 + 0.3 covers 0.7; the rest are never drawn
