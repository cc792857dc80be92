"""The format anchor: the KL to the served release where it is sure, on demonstration episodes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from tests.trainer.helpers import make_experiences
from trainer.online.anchor import FormatAnchor, anchor_kl
from trainer.online.config import FormatAnchorSettings, OnlineTrainerSettings
from trainer.online.trainer import OnlineTrainer


def test_the_anchor_holds_only_where_the_reference_is_sure() -> None:
    ref = torch.log(torch.tensor([[[0.95, 0.03, 0.02],    # sure: held
                                   [0.40, 0.30, 0.30],    # unsure: free
                                   [0.97, 0.02, 0.01]]]))  # sure, but not trained
    logits = torch.zeros(1, 3, 3, requires_grad=True)  # the policy: uniform everywhere
    mask = torch.tensor([[True, True, False]])
    kl, held = anchor_kl(torch.log_softmax(logits, -1), ref, mask, confidence=0.9)
    assert held.tolist() == [[True, False, False]]
    sure = ref[0, 0]
    expected = (sure.exp() * (sure - math.log(1 / 3))).sum()
    assert float(kl.detach()) == pytest.approx(float(expected))
    kl.backward()
    assert logits.grad is not None
    # the gradient moves the held position's distribution toward the reference's, and no other
    assert logits.grad[0, 0, 0] < 0 < logits.grad[0, 0, 1]
    assert torch.equal(logits.grad[0, 1:], torch.zeros(2, 3))
    same, _ = anchor_kl(ref, ref, mask, confidence=0.9)
    assert float(same) == 0.0


def test_a_step_draws_its_episodes_by_its_number(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    anchor = FormatAnchor.build(FormatAnchorSettings(coef=1.0, rows=4), tokenizer, pad_id=0)
    assert len(anchor.episodes) > 4 and all(sum(mask) > 0 for _, mask in anchor.episodes)
    assert torch.equal(anchor.batch(3).tokens, anchor.batch(3).tokens)  # a resume draws the same
    assert anchor.batch(3).tokens.shape[0] == 4
    draws = {tuple(anchor.batch(step).tokens.sum(1).tolist()) for step in range(8)}
    assert len(draws) > 1  # steps draw different episodes


def test_the_trainer_adds_the_anchor_to_its_step(model_dir: Path, tmp_path: Path) -> None:
    # the tiny random model is sure of nothing: every assistant position held at confidence ~0
    anchor = FormatAnchorSettings(coef=1.0, rows=2, confidence=1e-6)
    cfg = OnlineTrainerSettings(min_batch=4, max_batch=4, deterministic=True, lr=1e-3,
                                anchor=anchor)
    trainer = OnlineTrainer.restore(cfg, model_dir, tmp_path)
    assert trainer.anchor is not None
    experiences = make_experiences(model_dir, 8)
    first = trainer.step(experiences[:4])
    assert first["anchor_kl"] == pytest.approx(0.0, abs=1e-6)  # the policy is the reference
    assert first["anchor_held"] == 1.0
    second = trainer.step(experiences[4:])
    assert second["anchor_kl"] > 0  # one step moved the policy from the served release
