"""The `flywheel train-online` process: restore the trainer, open its Kafka source, run the loop.

On a rank other than the leader of a `torch.distributed` world the process restores the
trainer and follows the leader's phases (trainer/distributed.py) instead of running the loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ingest.config import KafkaConfig
from ingest.deletions import Forgotten
from ingest.log import EventProducer, ensure_topics
from trainer.distributed import World
from trainer.online.config import OnlineTrainerSettings
from trainer.online.control import TrainerControl
from trainer.online.intake import experience_source
from trainer.online.loop import OnlineLoop, OnlineReport
from trainer.online.monitor_watch import MonitorWatch
from trainer.online.trainer import OnlineTrainer
from trainer.release.pipeline import ReleaseSink
from trainer.trackers import TrackerSettings, build_trackers


class OnlineProcessSettings(Protocol):
    """What `run_online` reads of the process's settings (`app.settings.Settings` is one; the
    trainer may not import the app, so the edge is typed by this shape)."""

    @property
    def online(self) -> OnlineTrainerSettings: ...

    @property
    def trackers(self) -> TrackerSettings: ...

    @property
    def kafka_bootstrap(self) -> str | None: ...

    @property
    def data_dir(self) -> Path: ...

    @property
    def batch_invariant(self) -> bool: ...

    @property
    def resolved_model_dir(self) -> Path: ...

    @property
    def resolved_candidate_path(self) -> Path: ...

    def kafka_config(self, bootstrap: str) -> KafkaConfig: ...


def run_online(settings: OnlineProcessSettings, *, world: World | None = None,
               release_sink: ReleaseSink | None = None, control: TrainerControl | None = None,
               stop: threading.Event | None = None,
               on_step: Callable[[dict[str, float]], None] | None = None,
               forgotten: Forgotten | None = None) -> OnlineReport:
    """The `flywheel train-online` process: restore, consume, train, checkpoint, release,
    never training what `forgotten` (the users' deletions) passes over.
    On a rank other than the leader of `world`: restore, then follow the leader's phases."""
    cfg = settings.online
    if settings.kafka_bootstrap is None:
        raise RuntimeError("settings.kafka_bootstrap is unset: the trainer needs Kafka")
    root = cfg.resolved_checkpoint_dir(settings.data_dir)
    trainer = OnlineTrainer.restore(cfg, settings.resolved_model_dir, root,
                                   batch_invariant=settings.batch_invariant, world=world)
    if not trainer.world.leader:
        trainer.follow()
        trainer.close()
        return OnlineReport(trainer.state.step, trainer.ledger.trained, 0, [])
    kafka = settings.kafka_config(settings.kafka_bootstrap)
    ensure_topics(kafka)
    dlq = EventProducer(kafka, client_id="flywheel-trainer-dlq")
    source = experience_source(kafka, group_id=cfg.group_id, dlq=dlq)
    trackers = build_trackers(settings.trackers, "online", root,
                              params=cfg.model_dump(mode="json", exclude={"baseline"}))
    watch = MonitorWatch(kafka, cfg.monitors).start() if cfg.monitors.enabled else None
    try:
        loop = OnlineLoop(trainer, source, candidate_dir=root / "candidates",
                          latest_candidate=settings.resolved_candidate_path,
                          release_sink=release_sink, control=control, on_step=on_step,
                          trackers=trackers, forgotten=forgotten, watch=watch)
        return loop.run(stop)
    finally:
        if watch is not None:
            watch.close()
        trackers.close()
        trainer.finish()
        source.close()
        dlq.close()
        trainer.close()
