"""HTTP request and response models of the feedback and admin routes.

The OpenAI-compatible inference models live in `app/api/openai_schemas.py`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, Field, model_validator

from ingest.events import (
    FeedbackKind,
    FeedbackReceived,
    check_feedback_subject,
    check_feedback_value,
    utcnow,
)

_Id = Annotated[str, Field(min_length=1, max_length=128)]


class FeedbackRequest(BaseModel):
    """What the product sends about one generation (`generation_id`), or its verdict on a
    whole agent session (`session_id`: every generation of it): exactly one of the two.
    `occurred_at` null or absent means when received. Unknown fields are ignored.

    The public HTTP contract, apart from the Kafka wire event it becomes (`event()`,
    `ingest.events.FeedbackReceived`), so that either can change without the other; the two
    share their rules (`check_feedback_subject`, `check_feedback_value`)."""

    event_id: _Id
    generation_id: _Id | None = None
    session_id: _Id | None = None
    kind: FeedbackKind
    value: float | None = Field(default=None, strict=True, allow_inf_nan=False)  # a number
    occurred_at: datetime | None = None
    source: str = Field(default="api", max_length=64)

    @model_validator(mode="after")
    def _rules(self) -> FeedbackRequest:
        check_feedback_subject(self.generation_id, self.session_id)
        check_feedback_value(self.kind, self.value)
        return self

    def event(self) -> FeedbackReceived:
        """The wire event, received now (valid by the same rules, so not validated again)."""
        now = utcnow()
        return FeedbackReceived.model_construct(
            event_id=self.event_id, generation_id=self.generation_id,
            session_id=self.session_id, kind=self.kind, value=self.value,
            occurred_at=self.occurred_at or now, received_at=now, source=self.source)


class FeedbackAccepted(BaseModel):
    event_id: str
    duplicate: bool


class FeedbackBatchRequest(BaseModel):
    """Up to `Settings.feedback_batch_max` events in one signed request."""

    events: list[FeedbackRequest] = Field(min_length=1)


class FeedbackBatchAccepted(BaseModel):
    accepted: int
    duplicates: int
    results: list[FeedbackAccepted]


class StatusResponse(BaseModel):
    profile: str
    model_version: int
    model_sha256: str
    system_fingerprint: str
    kafka_bootstrap: str
    uptime_s: float
    completions: int
    feedback_accepted: int
    feedback_duplicates: int
    replica: dict[str, Any] | None = None  # release follower: version, swaps, pauses, refusals
    trainer: dict[str, Any] | None = None  # online trainer: step, consumed, lag, last release
    scavenger: dict[str, Any] | None = None  # off-peak rollouts: member, joins, groups made


class ReleaseRequest(BaseModel):
    """`POST /admin/releases`: build a release now (default candidate: the trainer's latest)."""

    candidate: str | None = Field(default=None, min_length=1, max_length=4096,
                                  description="checkpoint path (HF dir or .safetensors) under "
                                  "the data dir or the artifact store; default: "
                                  "release.candidate_path")
    requested_by: str = Field(default="admin", max_length=128)
    reason: str = Field(default="manual release", max_length=2000)


class ReleaseQueued(BaseModel):
    version: int
    task_id: str
    status: str = "queued"


class RollbackRequest(BaseModel):
    requested_by: str = Field(default="admin", max_length=128)
    reason: str = Field(default="manual rollback", max_length=2000)


class PromoteRequest(BaseModel):
    requested_by: str = Field(default="admin", max_length=128)
    reason: str = Field(default="manual promotion", max_length=2000)


class CanaryOut(BaseModel):
    """A release's canary (trainer/release/canary_stage.py): the test's figures per metric
    (both arms' means and sessions, the difference and its 95% interval, the LLR) and how
    it ended."""

    version: int
    parent: int
    share: float
    status: str
    figures: dict[str, dict[str, float | int | str]]
    started_at: datetime
    updated_at: datetime
    decided_at: datetime | None
    decided_by: str | None
    reason: str


class ReleaseOut(BaseModel):
    version: int
    parent: int | None
    kind: str
    status: str
    sha256: str
    manifest_uri: str | None
    snapshot_uri: str | None
    candidate_uri: str | None
    chain_length: int
    requested_by: str
    reason: str
    eval_summary: dict[str, float | int | str]
    step_range: list[int] | None
    generation_ids: list[str]
    feedback_event_ids: list[str]
    created_at: datetime
    published_at: datetime | None
    rolled_back_at: datetime | None
    rolled_back_by: str | None
    rollback_reason: str | None


class KeyRequest(BaseModel):
    """`POST /admin/keys`: an inference key for one user."""

    user_id: str = Field(min_length=1, max_length=128)
    rps: float | None = Field(default=None, gt=0.0, allow_inf_nan=False,
                              description="requests per second (per API replica); none: no "
                                          "limit")
    label: str | None = Field(default=None, max_length=200)
    private: bool = Field(default=False, description="every request in privacy mode: served, "
                          "never logged to sessions nor trained on")


class KeyInfo(BaseModel):
    """An inference key as listed: never its secret."""

    key_id: str
    user_id: str
    rps: float | None
    label: str | None
    private: bool
    created_at: datetime
    revoked_at: datetime | None


class KeyCreated(KeyInfo):
    """A new key: `key` is the whole key, shown this once (only its hash is kept)."""

    key: str


class DeletionRequest(BaseModel):
    """`POST /admin/deletions`: delete one user's data (`ingest.deletions`)."""

    user_id: str = Field(min_length=1, max_length=128)
    reason: str = Field(default="", max_length=2000)


class DeletionInfo(BaseModel):
    """A deletion as recorded: every generation of `user_id` up to `requested_at` is
    forgotten; the counts are what the join still held of them."""

    id: int
    user_id: str
    requested_at: datetime
    requested_by: str
    reason: str
    completed_at: datetime | None
    sessions: int = Field(description="stored sessions the join deleted")
    feedback: int = Field(description="feedback pending for them, deleted")
    verdicts: int = Field(description="session verdicts pending on their agent sessions")
    tombstones: int = Field(description="tombstones written to compacted topics")
