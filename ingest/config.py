"""Kafka configuration owned by `ingest`: topic names and client timeouts.

`app.settings.Settings` composes these and resolves the profile-dependent values into a
`KafkaConfig`, which is all the producer and consumers here ever see.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator


class TopicSettings(BaseModel):
    """Topic names and partition counts (see DESIGN.md, data contracts)."""

    sessions: str = "sessions"
    feedback: str = "feedback"
    experiences: str = "experiences"
    releases: str = "releases"
    dlq: str = "dlq"
    # the bootstrap's fleet: jobs to rollout workers, their groups back, policy versions out
    rollout_jobs: str = "rollout-jobs"
    rollouts: str = "rollouts"
    policy: str = "policy"
    # 6 divides evenly among 1, 2, 3 or 6 consumers: with 3, a second join member got one
    # partition to the first's two, and two members ran 1.2-1.5x one
    partitions: int = Field(default=6, ge=1, le=1024)
    replication_factor: int = Field(default=1, ge=1, le=7)
    # topics (of sessions, feedback, experiences) that `ensure_topics` creates compacted as
    # well as time-limited (`cleanup.policy=compact,delete`): a user's deletion writes
    # tombstones for their keys there, which compaction turns into the records' removal
    # before retention would. None by default: every topic is kept for its retention only.
    compacted: list[str] = Field(default_factory=list)

    def names(self) -> list[str]:
        return [self.sessions, self.feedback, self.experiences, self.releases, self.dlq,
                self.rollout_jobs, self.rollouts, self.policy]

    @model_validator(mode="after")
    def _compacted_keyed_by_user_data(self) -> TopicSettings:
        allowed = {self.sessions, self.feedback, self.experiences}
        if not set(self.compacted) <= allowed:
            raise ValueError(f"compacted topics are among {sorted(allowed)}, not "
                             f"{sorted(set(self.compacted) - allowed)}")
        return self


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


class RewardMap(BaseModel):
    """Feedback kind -> scalar reward. `edit_kept` pays `edit_kept_scale` x the kept fraction
    plus `edit_kept_offset` (defaults: the fraction itself)."""

    accept: float = 1.0
    reject: float = -1.0
    thumbs_up: float = 1.0
    thumbs_down: float = -1.0
    copied: float = 0.5
    regenerated: float = -0.5
    followup_dissatisfied: float = -0.5
    edit_kept_scale: float = 1.0
    edit_kept_offset: float = 0.0


class JoinSettings(BaseModel):
    """The sessions x feedback join (`flywheel join`, ingest/join.py).

    Session verdicts (feedback about a whole agent session, ingest/join_sessions.py): a
    verdict is expanded `session_settle_s` after the join stored it (the sessions log may lag
    the verdict), into one experience per generation of the session stored by then and
    generated no later than the verdict; turn k of T gets the verdict's reward times
    `session_discount ** (T - 1 - k)`: 1.0 (the default) gives every turn the session's
    outcome, as the bootstrap's multi-turn episodes do; below 1 the early turns get less.
    """

    group_id: str = Field(default="flywheel-join", min_length=1)
    database_url: str | None = None  # None: SQLite `join.db` under the data dir
    expire_after_s: float = Field(default=6 * 3600, gt=0)
    sweep_every_s: float = Field(default=5.0, gt=0)
    # records per SQL round; a poll that takes everything fetched lets the consumer send its
    # next fetches before the join works on this one (it fetches only for partitions with
    # nothing buffered): 20,000 against 5,000 cut the join loop's idle time per event by 40%
    max_poll_records: int = Field(default=20_000, ge=1, le=100_000)
    poll_timeout_ms: int = Field(default=200, ge=1)
    session_settle_s: float = Field(default=2.0, ge=0)
    session_discount: float = Field(default=1.0, gt=0, le=1)
    rewards: RewardMap = RewardMap()
