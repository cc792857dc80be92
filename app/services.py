"""The long-lived objects a running app holds, created in `lifespan`, replaceable in tests."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sqlalchemy import Engine as DbEngine

from app.feedback_intake import FeedbackIntake
from app.settings import Settings
from ingest.config import KafkaConfig
from ingest.log import EventProducer
from serving.engine import Engine


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
    feedback: FeedbackIntake | None = None  # built on first use when absent (tests)
