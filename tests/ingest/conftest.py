"""Fixtures of the join's tests: a fake clock, the join's SQL state (SQLite, or a fresh
PostgreSQL schema), members of one consumer group on the real broker, and a producer."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ingest.config import JoinSettings, KafkaConfig
from ingest.join import Join
from ingest.log import EventProducer


class Clock:
    """The join's clock, moved only by the test (`clock.now += 61`)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The join's SQL state: SQLite by default; `postgres` (indirect parameter) gives a fresh
    schema on the local PostgreSQL, dropped afterwards."""
    if getattr(request, "param", "sqlite") == "sqlite":
        return f"sqlite:///{tmp_path / 'join.db'}"
    return str(request.getfixturevalue("postgres_schema"))


@pytest.fixture
def make_join(kafka: KafkaConfig, database_url: str, clock: Clock
              ) -> Iterator[Callable[..., Join]]:
    joins: list[Join] = []
    group = f"join-{uuid.uuid4().hex[:8]}"

    def make(**overrides: object) -> Join:
        settings = JoinSettings(group_id=group, poll_timeout_ms=100, **overrides)
        join = Join(kafka, settings, database_url=database_url, clock=clock)
        joins.append(join)
        return join

    yield make
    for join in joins:
        join.close()


@pytest.fixture
def producer(kafka: KafkaConfig) -> Iterator[EventProducer]:
    p = EventProducer(kafka)
    yield p
    p.close()


