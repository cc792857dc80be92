"""The release pipeline (app/releases.py over trainer/release.py) on the real broker, SQLite
and the tiny model: gate, store, publish, snapshot cadence, rollback, and rebuilding the
served weights from the artifact store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sqlmodel import Session

from app.db import Release, make_db_engine
from app.releases import ReleaseConflictError, ReleaseContext, build_release, rollback_release
from app.settings import Settings
from ingest.events import ReleasePublished
from ingest.log import EventProducer, read_all
from kernels.delta import BaseMismatchError, DeltaVerificationError, prepare
from kernels.weights import state_dict_sha256
from trainer.release import head_weights, load_candidate, load_model, save_weights


def make_checkpoint(model_dir: Path, out: Path, *, scale: float, seed: int,
                    base: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A 'trainer checkpoint': the weights plus small seeded noise, as safetensors."""
    weights = base if base is not None else load_model(model_dir).state_dict()
    gen = torch.Generator().manual_seed(seed)
    new = {n: (t + scale * torch.randn(t.shape, generator=gen)).to(t.dtype)
           for n, t in weights.items()}
    new["lm_head.weight"] = new["model.embed_tokens.weight"]  # tied, as the model has them
    save_weights(new, out)
    return new


@pytest.fixture
def ctx(settings: Settings):
    settings = settings.model_copy(update={"release": settings.release.model_copy(
        update={"snapshot_every": 2})})
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    db = make_db_engine(settings.resolved_database_url)
    producer = EventProducer(settings.kafka_config(settings.kafka_bootstrap or ""))
    yield ReleaseContext(settings=settings, db=db, producer=producer)
    producer.close()
    db.dispose()


def test_candidate_round_trips_with_tied_weights(tmp_path: Path, model_dir: Path) -> None:
    new = make_checkpoint(model_dir, tmp_path / "c.safetensors", scale=1e-3, seed=1)
    loaded = load_candidate(tmp_path / "c.safetensors", model_dir)
    assert state_dict_sha256(loaded) == state_dict_sha256(new)


def test_publish_gate_snapshot_rollback(ctx: ReleaseContext, tmp_path: Path,
                                        model_dir: Path) -> None:
    good = [make_checkpoint(model_dir, tmp_path / f"c{i}.safetensors", scale=1e-3, seed=i)
            for i in range(3)]
    r1 = build_release(ctx, candidate=tmp_path / "c0.safetensors", requested_by="test")
    assert (r1.version, r1.parent, r1.status, r1.kind) == (1, 0, "published", "delta")
    assert r1.sha256 == state_dict_sha256(good[0])
    assert "candidate_loss" in r1.eval_summary

    make_checkpoint(model_dir, tmp_path / "bad.safetensors", scale=0.5, seed=9)
    bad = build_release(ctx, candidate=tmp_path / "bad.safetensors")
    assert bad.status == "rejected" and "regressed" in bad.reason

    r2 = build_release(ctx, candidate=tmp_path / "c1.safetensors")
    assert (r2.version, r2.parent, r2.kind, r2.chain_length) == (3, 1, "snapshot", 0)
    with pytest.raises(ReleaseConflictError):
        rollback_release(ctx, 1)
    back = rollback_release(ctx, 3, requested_by="test", reason="bad vibes")
    assert back.version == 1
    with Session(ctx.db) as session:
        assert session.get(Release, 3).status == "rolled_back"  # type: ignore[union-attr]
    # The head cache holds v3's weights; the pipeline rebuilds v1's from the store.
    assert state_dict_sha256(head_weights(ctx.config, back.version, back.sha256)) == r1.sha256
    r3 = build_release(ctx, candidate=tmp_path / "c2.safetensors")
    assert (r3.version, r3.parent) == (4, 1)

    events = read_all(ctx.settings.kafka_config(ctx.settings.kafka_bootstrap or ""),
                      ctx.settings.topics.releases, ReleasePublished)
    assert sorted((e.version, e.kind) for e in events) == [
        (0, "snapshot"), (1, "delta"), (1, "rollback"), (3, "snapshot"), (4, "snapshot")]


def test_delta_refuses_corruption_and_wrong_base(ctx: ReleaseContext, tmp_path: Path,
                                                 model_dir: Path) -> None:
    make_checkpoint(model_dir, tmp_path / "c.safetensors", scale=1e-3, seed=3)
    r1 = build_release(ctx, candidate=tmp_path / "c.safetensors")
    store = ctx.config.store
    manifest, reader = store.read_manifest(r1.version), store.shard_reader(r1.version)
    base = load_model(model_dir).state_dict()
    with pytest.raises(BaseMismatchError):
        prepare({n: t + 1 for n, t in base.items()}, manifest, reader)
    shard = Path(r1.manifest_uri or "").parent / manifest.shards[0].name
    blob = bytearray(shard.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    shard.write_bytes(bytes(blob))
    with pytest.raises(DeltaVerificationError):
        prepare(base, manifest, reader)
