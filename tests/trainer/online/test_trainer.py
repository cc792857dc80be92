"""The online trainer on the real tiny model: steps, ledger, batching, bitwise resume."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ingest.events import ExperienceReady
from ingest.log import Delivered
from tests.trainer.helpers import make_experiences
from trainer.checkpoint import Ledger, LedgerEntry
from trainer.online.config import BatchMeanBaseline, OnlineTrainerSettings
from trainer.online.intake import take_batch
from trainer.online.trainer import OnlineTrainer, warmup_factor


def _cfg(**kw: object) -> OnlineTrainerSettings:
    base = {"min_batch": 4, "max_batch": 4, "deterministic": True, "lr": 1e-3}
    return OnlineTrainerSettings(**{**base, **kw})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def experiences(model_dir: Path) -> list[ExperienceReady]:
    return make_experiences(model_dir, 12)


def test_step_updates_weights_and_ledger(model_dir: Path, tmp_path: Path,
                                         experiences: list[ExperienceReady]) -> None:
    trainer = OnlineTrainer.restore(_cfg(), model_dir, tmp_path)
    before = {n: t.clone() for n, t in trainer.model.state_dict().items()}
    metrics = trainer.step(experiences[:4])
    assert np.isfinite(metrics["loss"]) and metrics["batch"] == 4
    # First step: the trainer is the served model, so the importance weights are ~1.
    assert metrics["ratio"] == pytest.approx(1.0, abs=0.05)
    changed = [n for n, t in trainer.model.state_dict().items() if not torch.equal(t, before[n])]
    assert changed
    assert trainer.ledger.contains(experiences[0].experience_id)
    assert trainer.state.step == 1


def test_the_rate_warms_up_over_the_first_steps() -> None:
    assert [warmup_factor(step, 4) for step in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0


def test_a_refused_candidate_sends_the_trainer_back_to_the_served_weights(
        model_dir: Path, tmp_path: Path, experiences: list[ExperienceReady]) -> None:
    trainer = OnlineTrainer.restore(_cfg(), model_dir, tmp_path)
    served = {n: t.clone() for n, t in trainer.reference.state_dict().items()}
    trainer.step(experiences[:4])
    trainer.adopt_stashed(trainer.stash())  # handed over: the KL anchor from then on
    assert not all(torch.equal(t, served[n]) for n, t in trainer.reference.state_dict().items())
    trainer.step(experiences[4:8])
    assert not all(torch.equal(t, served[n]) for n, t in trainer.model.state_dict().items())
    trainer.revert_to_served(trainer.state.served_sha256 or "")
    assert all(torch.equal(t, served[n]) for n, t in trainer.model.state_dict().items())
    assert all(torch.equal(t, served[n]) for n, t in trainer.reference.state_dict().items())
    assert trainer.state.reference_sha256 == trainer.state.served_sha256
    assert not trainer.optimizer.state  # fresh moments
    assert trainer.state.warmup_from == trainer.state.step == 2
    trainer.step(experiences[:4])  # and it trains on from there
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(
        trainer.cfg.lr * warmup_factor(0, trainer.cfg.warmup_steps))


def test_records_logged_without_routes_train_beside_routed_ones(
        model_dir: Path, tmp_path: Path, experiences: list[ExperienceReady]) -> None:
    """A backend that cannot capture routes (vLLM on CPU) logs none: those rows replay
    nothing, the routed rows of the same batch still replay theirs."""
    mixed = [e.model_copy(update={"routed_experts": None}) if i % 2 else e
             for i, e in enumerate(experiences[:4])]
    trainer = OnlineTrainer.restore(_cfg(), model_dir, tmp_path)
    metrics = trainer.step(mixed)
    assert np.isfinite(metrics["loss"]) and metrics["batch"] == 4
    assert metrics["ratio"] == pytest.approx(1.0, abs=0.05)  # same weights, same tokens


def test_resume_from_checkpoint_is_bitwise(model_dir: Path, tmp_path: Path,
                                           experiences: list[ExperienceReady]) -> None:
    batches = [experiences[0:4], experiences[4:8], experiences[8:12]]
    straight = OnlineTrainer.restore(_cfg(), model_dir, tmp_path / "a")
    for batch in batches:
        straight.step(batch)
    first = OnlineTrainer.restore(_cfg(), model_dir, tmp_path / "b")
    first.step(batches[0])
    first.checkpoint()
    first.step(batches[1])  # trained but never checkpointed: lost in the "crash"
    resumed = OnlineTrainer.restore(_cfg(), model_dir, tmp_path / "b")
    assert resumed.state.step == 1
    for batch in batches[1:]:
        resumed.step(batch)
    for name, tensor in straight.model.state_dict().items():
        assert torch.equal(tensor, resumed.model.state_dict()[name]), name


def test_baselines_are_configurable(model_dir: Path, tmp_path: Path,
                                    experiences: list[ExperienceReady]) -> None:
    trainer = OnlineTrainer.restore(_cfg(baseline=BatchMeanBaseline()), model_dir, tmp_path)
    trainer.step(experiences[:4])
    bucket = OnlineTrainer.restore(_cfg(), model_dir, tmp_path / "bucket")
    bucket.step(experiences[:4])
    assert bucket.baseline.state_dict()["overall"][1] == 4


def _delivered(exps: list[ExperienceReady], partition: int, start: int) -> list[Delivered]:
    return [Delivered("experiences", partition, start + i, None, e) for i, e in enumerate(exps)]


def test_take_batch_skips_the_ledger_and_returns_prefix_offsets(
        experiences: list[ExperienceReady]) -> None:
    ledger = Ledger([LedgerEntry(0, [experiences[1].experience_id], ["g"], ["f"])])
    pending = (_delivered(experiences[0:3], 0, 10) + _delivered(experiences[3:6], 1, 0)
               + _delivered(experiences[0:1], 2, 5))  # a duplicate re-produced by the join
    assert take_batch(list(pending), ledger, min_batch=6, max_batch=6) is None
    batch = take_batch(pending, ledger, min_batch=2, max_batch=3)
    assert batch is not None
    assert [e.experience_id for e in batch.experiences] == [
        experiences[i].experience_id for i in (0, 2, 3)]
    assert batch.offsets == {"experiences:0": 13, "experiences:1": 1}
    assert batch.skipped == 1
    ids = [e.experience_id for e in batch.experiences]
    ledger.record(LedgerEntry(1, ids, ids, ids))  # what the trainer's step does
    rest = take_batch(pending, ledger, min_batch=1, max_batch=8)
    assert rest is not None and len(rest.experiences) == 2  # the duplicate is not retrained
    assert rest.offsets == {"experiences:1": 3, "experiences:2": 6}


def test_every_turn_of_a_conversation_shares_its_opening_bucket() -> None:
    """The baseline compares a turn with turns of conversations that opened alike (the task):
    the prompt is cut at its first assistant header."""
    from trainer.online.baseline import conversation_opening

    header = [1, 9]  # <|im_start|> assistant
    first = [1, 5, 6, 2, 1, 7, 8, 2, *header]  # system, user, assistant header
    later = [*first, 30, 31, 2, 1, 4, 40, 2, *header]  # + the reply, a tool turn, a header
    assert conversation_opening(first, header) == conversation_opening(later, header) == first[:8]
    assert conversation_opening([3, 4], header) == [3, 4]  # no assistant turn: the whole prompt
