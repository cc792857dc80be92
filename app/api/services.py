"""The long-lived objects a running app holds, created in `lifespan`, replaceable in tests."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import SecretStr
from sqlalchemy import Engine as DbEngine

from app.api.api_keys import KeyCheck, KeyChecker
from app.api.feedback_intake import FeedbackIntake
from app.api.metrics import Metrics
from app.settings import Settings
from ingest import join_store
from ingest.config import KafkaConfig
from ingest.events import GenerationLogged
from ingest.log import EventProducer
from ingest.sql import open_database
from serving.canary import ServedVersions
from serving.engine import Engine
from serving.live_load import LiveLoad


class GenerationLog(Protocol):
    """Where served generations are logged: `ingest.session_log.SessionLog` (to `sessions`,
    spooled), or a rollout worker's episodes (app/rollouts/endpoint.py)."""

    def submit(self, event: GenerationLogged) -> None: ...

    def close(self) -> None: ...


@dataclass
class Counters:
    completions: int = 0
    feedback_accepted: int = 0
    feedback_duplicates: int = 0


@dataclass
class Services:
    settings: Settings
    kafka: KafkaConfig
    engine: Engine
    producer: EventProducer
    db: DbEngine
    tokenizer: object
    started_at: float = field(default_factory=time.monotonic)
    counters: Counters = field(default_factory=Counters)
    session_log: GenerationLog | None = None  # None: completions are produced directly (tests)
    metrics: Metrics = field(default_factory=Metrics)
    celery: Any | None = None  # the Celery app release tasks go to; built on first use
    replica: Any | None = None  # serving.release_subscriber.ReleaseSubscriber when running
    feedback: FeedbackIntake | None = None  # see feedback_intake()
    console: Any | None = None  # app.api.console.ConsoleFeeds, see console_feeds()
    beacon: Any | None = None  # app.api.replicas.ReplicaBeacon: which version this replica serves
    live: LiveLoad = field(default_factory=LiveLoad)  # users' requests in flight and their rate
    scavenger: Any | None = None  # simulate.scavenge.Scavenger when scavenging is on
    canary_watch: Any | None = None  # trainer.release.canary_watch.CanaryWatch: decides canaries
    admin: SecretStr | None = None  # see admin_token()
    keys: KeyChecker | None = None  # see key_check()
    join_db: DbEngine | None = None  # see join_database()
    # which engine serves a session: `engine`, or a canary's beside it (serving/canary.py)
    versions: ServedVersions = field(init=False)

    def __post_init__(self) -> None:
        self.versions = ServedVersions(self.engine)

    def key_check(self) -> KeyChecker:
        """The inference keys' check (app/api/api_keys.py): the keys table's, made on first
        use, unless another was given."""
        if self.keys is None:
            self.keys = KeyCheck(self.db)
        return self.keys

    def join_database(self) -> DbEngine:
        """The join's SQL state (a user's deletion reaches into it), opened on first use."""
        if self.join_db is None:
            self.join_db = open_database(self.settings.resolved_join_database_url,
                                         join_store.TABLES)
        return self.join_db

    def admin_token(self) -> SecretStr:
        """The admin routes' bearer token (`Settings.admin_secret`), read once."""
        if self.admin is None:
            self.admin = self.settings.admin_secret()
        return self.admin

    def release_tasks(self) -> Any:
        if self.celery is None:
            from app.jobs.celery_app import make_celery

            self.celery = make_celery(self.settings)
        return self.celery

    def feedback_intake(self) -> FeedbackIntake:
        """The feedback webhooks' group committer (app/api/feedback_intake.py), started on first
        use."""
        if self.feedback is None:
            self.feedback = FeedbackIntake(
                producer=self.producer, topic=self.kafka.topics.feedback, db=self.db,
                delivery_timeout_s=self.kafka.delivery_timeout_ms / 1000)
        return self.feedback

    def console_feeds(self) -> Any:
        """The console's Kafka-side figures (app/api/console.py), started on first use."""
        if self.console is None:
            from app.api.console import ConsoleFeeds

            self.console = ConsoleFeeds(self.settings, self.kafka)
        return self.console
