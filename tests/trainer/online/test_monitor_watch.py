"""The monitors in the online trainer, on the real broker, DB and tiny model: a served version
that botches its tool calls pauses the trainer, records the breach with its sessions and
holds every release until an admin resumes it; a breach trips once."""

from __future__ import annotations

import random
import time
from pathlib import Path

from app.settings import Settings
from ingest.log import EventProducer, ensure_topics
from tests.trainer.online.test_control import RecordingSink
from tests.trainer.release.test_monitors import generation
from trainer.online.control import (
    SqlTrainerControl,
    breach_counts,
    enqueue_command,
    open_control_db,
    read_status,
    recent_breaches,
)
from trainer.online.intake import experience_source
from trainer.online.loop import OnlineLoop
from trainer.online.monitor_watch import MonitorWatch
from trainer.online.trainer import OnlineTrainer
from trainer.release.config import MonitorSettings


def test_a_version_that_botches_its_calls_pauses_the_trainer_and_holds_its_releases(
        settings: Settings, model_dir: Path) -> None:
    settings = settings.model_copy(update={"online": settings.online.model_copy(update={
        "control_every_s": 0.0})})
    kafka = settings.kafka_config(settings.kafka_bootstrap or "")
    ensure_topics(kafka)
    producer, rng = EventProducer(kafka), random.Random(0)
    for version, invalid in ((1, 0.05), (2, 0.40)):  # v2 dodges its rejections
        for i in range(300):
            broken = rng.random() < invalid
            g = generation(version, i, calls=0 if broken else 1, invalid=int(broken))
            producer.send(kafka.topics.sessions, g.generation_id, g)
    producer.flush()
    producer.close()

    settings.data_dir.mkdir(parents=True)
    db = open_control_db(settings.resolved_database_url)
    control = SqlTrainerControl(db)
    root = settings.data_dir / "trainer"
    trainer = OnlineTrainer.restore(settings.online, model_dir, root)
    source = experience_source(kafka, group_id="monitor-test", dlq=None)
    watch = MonitorWatch(kafka, MonitorSettings(min_generations=200)).start()
    sink = RecordingSink()
    loop = OnlineLoop(trainer, source, candidate_dir=root / "candidates", release_sink=sink,
                      control=control, watch=watch)
    try:
        deadline = time.monotonic() + 60
        while not loop.held and time.monotonic() < deadline:
            loop._watch_monitors()
            time.sleep(0.1)
        assert loop.paused and [b.monitor for b in loop.held] == ["invalid_call"]
        (row,) = recent_breaches(db)
        assert row.monitor == "invalid_call" and row.version == 2 and row.value > 0.3
        assert row.sessions and all(s.startswith("s-2-") for s in row.sessions)
        assert breach_counts(db) == {"invalid_call": 1}
        status = read_status(db)
        assert status is not None and status.paused
        # no release while held, not even one an admin asks for
        held = loop.release(requested_by="admin", reason="ship it anyway")
        assert not held["released"] and held["reason"].startswith("held by the monitors")
        assert "invalid_call on v2" in held["reason"] and sink.calls == []
        # resuming acknowledges it: the same breach does not trip again
        enqueue_command(db, "resume")
        loop._handle_control()
        assert not loop.paused and not loop.held
        loop._watch_monitors()
        assert not loop.paused and len(recent_breaches(db)) == 1
        # report only: the next breach is recorded, and the trainer goes on
        loop.cfg = loop.cfg.model_copy(update={"monitors": MonitorSettings(
            on_breach="report")})
        watch.monitors.settings = MonitorSettings(min_generations=200, max_kl=0.01)
        for _ in range(10):
            watch.note_step({"kl": 0.05})
        loop._watch_monitors()
        assert [b.monitor for b in recent_breaches(db)] == ["trainer_kl", "invalid_call"]
        assert not loop.paused and not loop.held
    finally:
        watch.close()
        source.close()
