"""Trainer control over SQL and the release handoff, on the real broker, DB and tiny model."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from app.settings import Settings
from ingest.log import EventProducer
from tests.trainer.helpers import make_experiences
from trainer.online.control import (
    SqlTrainerControl,
    enqueue_command,
    open_control_db,
    read_status,
)
from trainer.online.intake import experience_source, stale_before, take_batch
from trainer.online.loop import OnlineLoop
from trainer.online.trainer import OnlineTrainer
from trainer.release.pipeline import ReleaseOutcome


class RecordingSink:
    """Stands in for the release pipeline (tested on its own): records what it was handed."""

    def __init__(self) -> None:
        self.calls: list[tuple[Path, dict[str, Any]]] = []

    def release(self, candidate: Path, provenance: dict[str, Any], *, requested_by: str,
                reason: str) -> ReleaseOutcome:
        self.calls.append((candidate, provenance))
        return ReleaseOutcome(version=len(self.calls), published=True, sha256="s" * 64)

    def status(self, version: int) -> str:
        return "published"


class CanarySink(RecordingSink):
    """Every release goes to a canary: v1's is rolled back once the trainer has trained on
    to step 4, v2's promoted at the third look. Records the trainer's step and KL anchor at
    each look."""

    def __init__(self, trainer: OnlineTrainer) -> None:
        super().__init__()
        self.trainer = trainer
        self.looks: dict[int, list[int]] = {}
        self.anchors: dict[int, set[str | None]] = {}

    def release(self, candidate: Path, provenance: dict[str, Any], *, requested_by: str,
                reason: str) -> ReleaseOutcome:
        outcome = super().release(candidate, provenance, requested_by=requested_by,
                                  reason=reason)
        return ReleaseOutcome(version=outcome.version, published=True, sha256="s" * 64,
                              parent=outcome.version - 1, canary=True)

    def status(self, version: int) -> str:
        step = self.trainer.state.step
        self.looks.setdefault(version, []).append(step)
        self.anchors.setdefault(version, set()).add(self.trainer.state.reference_sha256)
        if version == 1:
            return "canary" if step < 4 else "rolled_back"
        return "canary" if len(self.looks[version]) < 3 else "published"


def test_pause_resume_release_and_status(settings: Settings, model_dir: Path) -> None:
    settings = settings.model_copy(update={"online": settings.online.model_copy(update={
        "min_batch": 4, "max_batch": 4, "deterministic": True, "control_every_s": 0.01,
        "release_in_background": True})})
    kafka = settings.kafka_config(settings.kafka_bootstrap or "")
    experiences = make_experiences(model_dir, 4)
    producer = EventProducer(kafka)
    for exp in experiences:
        producer.send(kafka.topics.experiences, exp.experience_id, exp)
    producer.flush()
    producer.close()

    settings.data_dir.mkdir(parents=True)
    db = open_control_db(settings.resolved_database_url)
    control = SqlTrainerControl(db)
    root = settings.data_dir / "trainer"
    trainer = OnlineTrainer.restore(settings.online, model_dir, root)
    source = experience_source(kafka, group_id="control-test", dlq=None)
    sink = RecordingSink()
    loop = OnlineLoop(trainer, source, candidate_dir=root / "candidates",
                      latest_candidate=settings.resolved_candidate_path, release_sink=sink,
                      control=control)
    try:
        enqueue_command(db, "pause")
        loop._handle_control()
        assert loop.paused and not control.pending()
        enqueue_command(db, "resume")
        time.sleep(0.02)
        loop._handle_control()
        assert not loop.paused
        deadline = time.monotonic() + 60
        while trainer.state.step == 0 and time.monotonic() < deadline:
            loop.pending.extend(source.poll(timeout_ms=200))
            batch = take_batch(loop.pending, trainer.ledger, min_batch=4, max_batch=4)
            if batch is not None:
                loop._train(batch)
        assert trainer.state.step == 1
        assert settings.resolved_candidate_path.exists()  # POST /admin/releases builds this
        reference_before = trainer.state.reference_sha256
        command = enqueue_command(db, "release", reason="test")
        time.sleep(0.02)
        loop._handle_control()  # handed to the pipeline, built on a thread
        assert [c.id for c in control.pending()] == [command]  # answered once built
        loop.finish_release(wait=True)
        assert not control.pending()
    finally:
        source.close()
    (candidate, provenance), = sink.calls
    assert candidate.exists()
    assert provenance["step_range"] == [0, 0]
    assert sorted(provenance["generation_ids"]) == sorted(e.generation_id for e in experiences)
    assert sorted(provenance["feedback_event_ids"]) == sorted(
        e.feedback_event_ids[0] for e in experiences)
    assert trainer.state.reference_sha256 != reference_before  # KL anchor = served release
    assert trainer.state.release_from_step == 1
    status = read_status(db)
    assert status is not None and status.step == 1 and status.consumed == 4
    assert status.last_release_version == 1 and status.lag == 0
    torch.use_deterministic_algorithms(False)


def produced_experiences(settings: Settings, model_dir: Path, n: int) -> tuple[Any, Path]:
    """`n` experiences on the settings' topic: (the Kafka config, the trainer's root)."""
    kafka = settings.kafka_config(settings.kafka_bootstrap or "")
    producer = EventProducer(kafka)
    for exp in make_experiences(model_dir, n):
        producer.send(kafka.topics.experiences, exp.experience_id, exp)
    producer.flush()
    producer.close()
    return kafka, settings.data_dir / "trainer"


class RefuseFirstSink(RecordingSink):
    """The first candidate is refused (by the gate, say), or its build fails (`fail`); the
    others are published."""

    def __init__(self, *, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail

    def release(self, candidate: Path, provenance: dict[str, Any], *, requested_by: str,
                reason: str) -> ReleaseOutcome:
        outcome = super().release(candidate, provenance, requested_by=requested_by,
                                  reason=reason)
        if len(self.calls) > 1:
            return outcome
        if self.fail:
            raise SystemError("AST constructor recursion depth mismatch")  # as seen in a demo
        return ReleaseOutcome(version=1, published=False, sha256="", reason="refused")


@pytest.mark.parametrize("fail", [False, True], ids=["refused", "build_failed"])
def test_a_release_every_n_steps_whatever_the_gate_said(settings: Settings, model_dir: Path,
                                                         fail: bool) -> None:
    """`release_every_steps`: a candidate every 2 steps, the next still cut 2 steps after a
    refusal (not on every step after it). A candidate the gate refused is dropped: the
    trainer goes back to the served weights, warms its rate up again, and the next candidate
    holds only the steps after it. One whose build failed is not judged: its steps go into
    the next, trained on from its weights."""
    online = settings.online.model_copy(update={
        "min_batch": 2, "max_batch": 2, "release_every_steps": 2, "stop_after": 8,
        "deterministic": True})
    kafka, root = produced_experiences(settings, model_dir, 8)
    trainer = OnlineTrainer.restore(online, model_dir, root)
    source = experience_source(kafka, group_id="cadence-test", dlq=None)
    sink = RefuseFirstSink(fail=fail)
    try:
        OnlineLoop(trainer, source, candidate_dir=root / "candidates",
                   release_sink=sink).run()
    finally:
        source.close()
    ranges = [[0, 1], [0, 3]] if fail else [[0, 1], [2, 3]]
    assert [p["step_range"] for _, p in sink.calls] == ranges
    assert trainer.state.release_from_step == 4
    assert trainer.state.warmup_from == (0 if fail else 2)
    torch.use_deterministic_algorithms(False)


def test_bounded_staleness_passes_over_what_an_older_release_served(
        settings: Settings, model_dir: Path) -> None:
    """`max_staleness` 0: once a release is published, the backlog generated before it is
    passed over (counted as stale, never trained) and the next step trains on what was
    generated after it. The records share one key, so one partition keeps their order."""
    online = settings.online.model_copy(update={
        "min_batch": 2, "max_batch": 2, "release_every_steps": 1, "stop_after_releases": 2,
        "max_staleness": 0, "deterministic": True})
    kafka = settings.kafka_config(settings.kafka_bootstrap or "")
    now = time.time()
    made = make_experiences(model_dir, 6)
    ages = [-20, -20, -10, -10, 3600, 3600]  # seconds from now: two before, two after
    experiences = [e.model_copy(update={"generated_at": datetime.fromtimestamp(now + age, UTC)})
                   for e, age in zip(made, ages, strict=True)]
    producer = EventProducer(kafka)
    for exp in experiences:
        producer.send(kafka.topics.experiences, "one-partition", exp)
    producer.flush()
    producer.close()
    root = settings.data_dir / "trainer"
    trainer = OnlineTrainer.restore(online, model_dir, root)
    source = experience_source(kafka, group_id="staleness-test", dlq=None)
    try:
        report = OnlineLoop(trainer, source, candidate_dir=root / "candidates",
                            release_sink=RecordingSink()).run()
    finally:
        source.close()
    trained = [entry.experience_ids for entry in trainer.ledger.between(0, 1)]
    assert trained == [[e.experience_id for e in experiences[0:2]],
                       [e.experience_id for e in experiences[4:6]]]
    assert report.stale == 2 and report.steps == 2
    assert len(trainer.state.published_at) == 2
    torch.use_deterministic_algorithms(False)


def test_the_staleness_cut_is_the_publication_of_the_oldest_release_allowed() -> None:
    assert stale_before([], 0) is None  # nothing published yet: everything is fresh
    assert stale_before([10.0, 20.0], None) is None  # no bound
    assert stale_before([10.0, 20.0], 0) == 20.0
    assert stale_before([10.0, 20.0], 1) == 10.0
    assert stale_before([10.0], 1) is None  # one release so far: version 0's traffic is fresh


def test_the_trainer_trains_on_through_a_canary_and_follows_its_decision(
        settings: Settings, model_dir: Path) -> None:
    """A release in its canary: the trainer trains on from its weights, and the next release
    waits for the decision. Rolled back (v1, at step 4): back to the served weights, the
    steps since dropped, the canary's sessions stale. Through each canary the KL anchor is
    the candidate's weights, stashed when they were handed over (the trainer trains on from
    them); rolled back, the served ones again. Promoted (v2): it counts as a release (the loop
    stops after one)."""
    online = settings.online.model_copy(update={
        "min_batch": 2, "max_batch": 2, "release_every_steps": 2, "stop_after_releases": 1,
        "deterministic": True, "control_every_s": 0.01})
    kafka, root = produced_experiences(settings, model_dir, 12)
    trainer = OnlineTrainer.restore(online, model_dir, root)
    source = experience_source(kafka, group_id="canary-test", dlq=None)
    sink = CanarySink(trainer)
    reference = trainer.state.reference_sha256
    try:
        report = OnlineLoop(trainer, source, candidate_dir=root / "candidates",
                            release_sink=sink).run()
    finally:
        source.close()
    assert sink.looks[1][-1] == 4 and min(sink.looks[1]) == 2  # trained on through it
    assert [p["step_range"] for _, p in sink.calls] == [[0, 1], [4, 5]]
    assert [(r["version"], r["canary"], r["released"]) for r in report.releases] == [
        (1, "rolled_back", False), (2, "promoted", True)]
    state = trainer.state
    assert state.warmup_from == 4 and state.stale_versions == [1] and state.canary is None
    (v1_anchor,), (v2_anchor,) = sink.anchors[1], sink.anchors[2]
    assert len({reference, v1_anchor, v2_anchor}) == 3  # each candidate's own weights
    assert state.reference_sha256 == state.served_sha256 == v2_anchor
    assert trainer.store.load_reference(state.reference_sha256 or "")
    torch.use_deterministic_algorithms(False)


class SlowGateSink(RecordingSink):
    """Each build waits for the test to let it through (a gate taking its time), then the
    first candidate is refused and the others are published."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Semaphore(0)

    def release(self, candidate: Path, provenance: dict[str, Any], *, requested_by: str,
                reason: str) -> ReleaseOutcome:
        outcome = super().release(candidate, provenance, requested_by=requested_by,
                                  reason=reason)
        assert self.gate.acquire(timeout=120)
        if len(self.calls) == 1:
            return ReleaseOutcome(version=1, published=False, sha256="", reason="refused")
        return outcome


def test_the_trainer_trains_on_while_its_candidate_is_gated(settings: Settings,
                                                              model_dir: Path) -> None:
    """`release_in_background`: while the pipeline builds a candidate the trainer trains on
    from it, and the next candidate waits for the build. Refused (steps 0-1): the steps
    trained since are dropped with it. Published (steps 4-5, then 6-7): the steps trained
    since go into the next, and the KL anchor is the weights handed over, not the trainer's."""
    online = settings.online.model_copy(update={
        "min_batch": 2, "max_batch": 2, "release_every_steps": 2, "stop_after_releases": 2,
        "deterministic": True, "control_every_s": 0.01, "release_in_background": True})
    kafka, root = produced_experiences(settings, model_dir, 20)
    trainer = OnlineTrainer.restore(online, model_dir, root)
    source = experience_source(kafka, group_id="background-test", dlq=None)
    sink = SlowGateSink()
    loop = OnlineLoop(trainer, source, candidate_dir=root / "candidates", release_sink=sink)
    reports: list[Any] = []
    runner = threading.Thread(target=lambda: reports.append(loop.run()), daemon=True)

    def trained_to(step: int, calls: int) -> None:
        deadline = time.monotonic() + 120
        while (trainer.state.step, len(sink.calls)) != (step, calls):
            assert time.monotonic() < deadline, (trainer.state.step, len(sink.calls))
            time.sleep(0.05)
        time.sleep(0.3)  # and no further: the next candidate waits for this build
        assert (trainer.state.step, len(sink.calls)) == (step, calls)

    runner.start()
    try:
        trained_to(4, 1)  # steps 2-3 trained during the first build
        sink.gate.release()  # refused
        trained_to(8, 2)
        sink.gate.release()  # published; steps 6-7 are handed over at once
        trained_to(10, 3)
        sink.gate.release()
        runner.join(timeout=120)
    finally:
        for _ in range(3):
            sink.gate.release()
        runner.join(timeout=120)
        source.close()
    assert [p["step_range"] for _, p in sink.calls] == [[0, 1], [4, 5], [6, 7]]
    assert [r["released"] for r in reports[0].releases] == [False, True, True]
    assert trainer.state.warmup_from == 4  # back to the served weights after the refusal
    shipped = load_file(str(sink.calls[-1][0]))  # at step 8; the trainer is at step 10
    reference, current = trainer.reference.state_dict(), trainer.model.state_dict()
    names = [name for name in shipped if name in reference]
    assert names and all(torch.equal(reference[n].to(shipped[n].dtype), shipped[n])
                         for n in names)
    assert not all(torch.equal(current[n].to(shipped[n].dtype), shipped[n]) for n in names)
    torch.use_deterministic_algorithms(False)
