"""Packing a session's turns into one row: the layout, and the same gradient for less work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ingest.events import ExperienceReady, PackedArray, SamplingParams, utcnow
from trainer.online.batch import pack_rows
from trainer.online.config import BatchMeanBaseline, OnlineTrainerSettings
from trainer.online.trainer import OnlineTrainer


def turn(session: str | None, k: int, prompt: list[int], completion: list[int], *,
         reward: float = 1.0, temperature: float = 1.0) -> ExperienceReady:
    return ExperienceReady(
        experience_id=f"exp-{session}-{k}", generation_id=f"gen-{session}-{k}",
        feedback_event_ids=["verdict"], feedback_kind="accept", reward=reward,
        model_version=0, model_sha256="0" * 64,
        prompt_token_ids=PackedArray.pack(prompt, "int32"),
        completion_token_ids=PackedArray.pack(completion, "int32"),
        logprobs=PackedArray.pack([-0.5] * len(completion), "float32"),
        sampling=SamplingParams(temperature=temperature), finish_reason="stop",
        generated_at=utcnow(), session_id=session, turn=None if session is None else k,
        turns=None if session is None else 3)


SESSION = [turn("s", 0, [1, 2], [3, 4]), turn("s", 1, [1, 2, 3, 4, 5], [6]),
           turn("s", 2, [1, 2, 3, 4, 5, 6, 7], [8, 9])]


def test_a_sessions_turns_share_one_row_in_turn_order() -> None:
    (row,) = pack_rows(list(reversed(SESSION)), [3.0, 2.0, 1.0])  # advantages of turns 2, 1, 0
    assert row.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert row.mask == [0, 0, 1, 1, 0, 1, 0, 1, 1]
    assert row.advantage == [0, 0, 1, 1, 0, 2, 0, 3, 3]
    assert row.behavior == [0, 0, -0.5, -0.5, 0, -0.5, 0, -0.5, -0.5]
    assert [e.turn for e in row.experiences] == [0, 1, 2]


def test_a_turn_that_does_not_continue_the_row_starts_its_own() -> None:
    retokenized = turn("s", 1, [1, 2, 30, 5], [6])  # the server tokenized turn 0 otherwise
    hotter = turn("s", 2, [1, 2, 30, 5, 6, 7], [8], temperature=0.7)
    single = turn(None, 0, [1, 2], [3])
    rows = pack_rows([SESSION[0], retokenized, hotter, single], [1.0] * 4)
    assert sorted(len(r.experiences) for r in rows) == [1, 1, 1, 1]


def test_packed_rows_give_the_gradient_of_one_row_per_turn(model_dir: Path) -> None:
    """A causal model scores a turn's tokens from its prefix alone, so packing changes the
    work, not the loss or its gradient."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    a = tok("def add(a, b):")["input_ids"]
    b, c = tok(" return a + b")["input_ids"], tok("\n# done")["input_ids"]
    session = [turn("s", 0, a, b, reward=1.0), turn("s", 1, a + b + [7], c, reward=1.0),
               turn("t", 0, a, c, reward=-1.0)]
    grads = []
    for pack in (True, False):
        cfg = OnlineTrainerSettings(deterministic=True, router_replay=False,
                                    baseline=BatchMeanBaseline(), kl_coef=0.1)
        trainer = OnlineTrainer.restore(cfg, model_dir, model_dir.parent / f"ckpt-{pack}")
        experiences = session if pack else [e.model_copy(update={"session_id": None,
                                                                 "turn": None, "turns": None})
                                            for e in session]
        metrics = trainer.forward_backward(experiences)
        assert metrics["rows"] == (2 if pack else 3)
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters()
                                if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    assert grads[0].abs().sum() > 0


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)
