"""Kafka configuration owned by `ingest`: topic names and client timeouts.

`app.settings.Settings` composes these and resolves the profile-dependent values into a
`KafkaConfig`, which is all the producer and consumers here ever see.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class TopicSettings(BaseModel):
    """Topic names and partition counts (see DESIGN.md, data contracts)."""

    sessions: str = "sessions"
    feedback: str = "feedback"
    experiences: str = "experiences"
    releases: str = "releases"
    rollouts: str = "rollouts"
    dlq: str = "dlq"
    partitions: int = Field(default=3, ge=1, le=1024)
    replication_factor: int = Field(default=1, ge=1, le=7)

    def names(self) -> list[str]:
        return [self.sessions, self.feedback, self.experiences, self.releases, self.rollouts,
                self.dlq]


class KafkaClientSettings(BaseModel):
    """Client timeouts. `None` means: use the profile's value."""

    session_timeout_ms: int | None = Field(default=None, ge=1000)
    heartbeat_interval_ms: int | None = Field(default=None, ge=100)
    request_timeout_ms: int = Field(default=15_000, ge=1000)
    delivery_timeout_ms: int = Field(default=30_000, ge=1000)
    linger_ms: int = Field(default=5, ge=0)


class KafkaConfig(BaseModel):
    """Everything a Kafka client here needs, resolved: no profile logic below this point."""

    bootstrap: str
    topics: TopicSettings = TopicSettings()
    session_timeout_ms: int = Field(default=6_000, ge=1000)
    heartbeat_interval_ms: int = Field(default=2_000, ge=100)
    request_timeout_ms: int = Field(default=15_000, ge=1000)
    delivery_timeout_ms: int = Field(default=30_000, ge=1000)
    linger_ms: int = Field(default=5, ge=0)
