"""Helpers of the ingest tests: produce sessions and feedback, drive a join until a condition
holds."""

from __future__ import annotations

import time
from collections.abc import Callable

from ingest.config import KafkaConfig
from ingest.events import FeedbackReceived, GenerationLogged
from ingest.join import Join
from ingest.log import EventProducer


def run_until(join: Join, done: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"join did not get there: {join.stats}"
        join.step()


def produce(producer: EventProducer, kafka: KafkaConfig, *events: object) -> None:
    """Sessions to `sessions`, feedback to `feedback`, each under its key; flushed."""
    for event in events:
        if isinstance(event, GenerationLogged):
            producer.send(kafka.topics.sessions, event.generation_id, event)
        else:
            assert isinstance(event, FeedbackReceived)
            producer.send(kafka.topics.feedback, event.key, event)
    producer.flush()
