"""`FLYWHEEL_BATCH_INVARIANT`: one setting puts the serving engine and the trainers in the mode."""

from __future__ import annotations

from pathlib import Path

from app.settings import Settings
from kernels.batch_invariant import is_batch_invariant
from serving.backends import build_engine
from trainer.online.trainer import OnlineTrainer


def test_one_switch_reaches_engine_and_online_trainer(model_dir: Path, tmp_path: Path,
                                                      monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("FLYWHEEL_BATCH_INVARIANT", "true")
    settings = Settings(data_dir=tmp_path, model_dir=model_dir)
    assert settings.batch_invariant
    engine = build_engine(settings.engine, model_dir, batch_invariant=settings.batch_invariant)
    try:
        assert is_batch_invariant(engine.model)  # type: ignore[attr-defined]
    finally:
        engine.close()
    trainer = OnlineTrainer.restore(settings.online, model_dir, tmp_path / "ckpt",
                                    batch_invariant=settings.batch_invariant)
    assert is_batch_invariant(trainer.model) and is_batch_invariant(trainer.reference)


def test_off_by_default(model_dir: Path) -> None:
    settings = Settings(model_dir=model_dir)
    engine = build_engine(settings.engine, model_dir, batch_invariant=settings.batch_invariant)
    try:
        assert not is_batch_invariant(engine.model)  # type: ignore[attr-defined]
    finally:
        engine.close()
