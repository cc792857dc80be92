"""The release pipeline (trainer/release/pipeline.py) on the real broker, SQLite and the tiny model:
gate, store, publish, snapshot cadence, rollback, and rebuilding the served weights from the
artifact store."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlmodel import Session

from app.settings import Settings
from ingest.events import ReleasePublished
from ingest.topic_reader import read_all
from kernels.delta import BaseMismatchError, DeltaVerificationError, prepare
from kernels.weights import state_dict_sha256
from tests.conftest import skilled_model
from tests.trainer.helpers import make_checkpoint
from trainer.release.config import HeldOutLossEval
from trainer.release.pipeline import (
    PipelineReleaseSink,
    Release,
    ReleaseConflictError,
    ReleaseContext,
    build_release,
    open_release_context,
    rollback_release,
)
from trainer.release.weights import (
    ReleaseError,
    artifact_store,
    head_weights,
    load_candidate,
    load_model,
    save_weights,
)


@pytest.fixture
def ctx(settings: Settings):
    """The loss gate: the random tiny model solves no task, so pass@1 could not tell."""
    release = settings.release.model_copy(update={"snapshot_every": 2, "eval": HeldOutLossEval()})
    with open_release_context(settings.model_copy(update={"release": release})
                              .release_config()) as ctx:
        yield ctx


def test_candidate_round_trips_with_tied_weights(tmp_path: Path, model_dir: Path) -> None:
    new = make_checkpoint(model_dir, tmp_path / "c.safetensors", scale=1e-3, seed=1)
    loaded = load_candidate(tmp_path / "c.safetensors", model_dir)
    assert state_dict_sha256(loaded) == state_dict_sha256(new)
    # a file without the tied LM head loads the same (the model ties it to the embeddings);
    # one without an untied tensor is refused, naming it
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tmp_path / "c.safetensors"))
    save_file({n: t for n, t in weights.items() if n != "lm_head.weight"},
              str(tmp_path / "headless.safetensors"))
    assert state_dict_sha256(load_candidate(tmp_path / "headless.safetensors", model_dir)) \
        == state_dict_sha256(new)
    dropped = next(n for n in weights if n.endswith("norm.weight"))
    save_file({n: t for n, t in weights.items() if n != dropped},
              str(tmp_path / "short.safetensors"))
    with pytest.raises(ReleaseError, match="lacks tensors"):
        load_candidate(tmp_path / "short.safetensors", model_dir)


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
    assert bad.status == "rejected" and "loss 7.6" in bad.reason and "worse by" in bad.reason

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

    events = read_all(ctx.config.kafka, ctx.config.kafka.topics.releases, ReleasePublished)
    assert sorted((e.version, e.kind) for e in events) == [
        (0, "snapshot"), (1, "delta"), (1, "rollback"), (3, "snapshot"), (4, "snapshot")]


def test_the_online_trainers_sink_records_what_the_weights_were_trained_on(
        ctx: ReleaseContext, tmp_path: Path, model_dir: Path) -> None:
    make_checkpoint(model_dir, tmp_path / "c.safetensors", scale=1e-3, seed=4)
    provenance = {"step_range": [0, 3], "generation_ids": ["g1", "g2"],
                  "feedback_event_ids": ["f1"]}
    outcome = PipelineReleaseSink(ctx.config).release(
        tmp_path / "c.safetensors", provenance, requested_by="trainer", reason="interval")
    assert (outcome.version, outcome.published) == (1, True)
    with Session(ctx.db) as session:
        row = session.get(Release, 1)
        assert row is not None and (row.status, row.requested_by) == ("published", "trainer")
        assert (row.step_range, row.generation_ids, row.feedback_event_ids) == (
            [0, 3], ["g1", "g2"], ["f1"])


def test_delta_refuses_corruption_and_wrong_base(ctx: ReleaseContext, tmp_path: Path,
                                                 model_dir: Path) -> None:
    make_checkpoint(model_dir, tmp_path / "c.safetensors", scale=1e-3, seed=3)
    r1 = build_release(ctx, candidate=tmp_path / "c.safetensors")
    store = artifact_store(ctx.config)
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


@pytest.fixture(scope="module")
def skilled_model_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model mid-trained on the two gate tasks' demonstrations until it solves them:
    a served version with an ability to lose."""
    return skilled_model(model_dir, tmp_path_factory.mktemp("gate"), steps=120)


def test_held_out_pass_at_1_gate_refuses_a_damaged_candidate(
        settings: Settings, skilled_model_dir: Path, tmp_path: Path) -> None:
    """The default gate: held-out pass@1 of the agent in the sandbox, compared task by task.
    The served version solves both held-out tasks (greedy, so every sample alike); a
    candidate with damaged weights solves none and is refused and recorded; the same weights
    again pass."""
    from simulate.tasks import JsonlTasksConfig

    tasks = JsonlTasksConfig(path=skilled_model_dir / "tasks.jsonl", held_out_fraction=1.0)
    assert settings.release.eval.kind == "held_out_tasks"
    settings = settings.model_copy(update={
        "model_dir": skilled_model_dir,
        "bootstrap": settings.bootstrap.model_copy(update={"tasks": tasks}),
        "release": settings.release.model_copy(update={"eval": settings.release.eval.model_copy(
            update={"temperature": 0.0, "samples_per_task": 2})})})
    with open_release_context(settings.release_config()) as ctx:
        served = load_model(skilled_model_dir).state_dict()
        make_checkpoint(skilled_model_dir, tmp_path / "damaged.safetensors", scale=0.3, seed=1,
                        base=served)
        damaged = build_release(ctx, candidate=tmp_path / "damaged.safetensors")
        assert damaged.status == "rejected"
        assert damaged.eval_summary["served_pass_at_1"] == 1.0
        assert damaged.eval_summary["candidate_pass_at_1"] == 0.0
        assert damaged.eval_summary["change"] == -1.0
        assert damaged.reason.startswith("pass_at_1 100.0% -> 0.0%: change -100.0% over 2 tasks")
        save_weights(served, tmp_path / "same.safetensors")
        same = build_release(ctx, candidate=tmp_path / "same.safetensors")
        assert same.status == "published" and same.eval_summary["candidate_pass_at_1"] == 1.0
        with Session(ctx.db) as session:
            assert session.get(Release, damaged.version).status == "rejected"  # type: ignore[union-attr]
