"""HTTP request and response models of the feedback and admin routes.

The OpenAI-compatible inference models live in `app/openai_schemas.py`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic.config import JsonDict

from ingest.events import FeedbackReceived, utcnow

# a sender's value for these is ignored, like an unknown field's
_SET_BY_THE_SERVER = ("event", "schema_version", "received_at")


def _document_inputs(schema: JsonDict) -> None:
    """`FeedbackRequest`'s JSON schema: the fields a sender gives, `occurred_at` nullable."""
    properties = schema["properties"]
    assert isinstance(properties, dict)
    for name in _SET_BY_THE_SERVER:
        del properties[name]
    properties["occurred_at"] = {"anyOf": [{"type": "string", "format": "date-time"},
                                           {"type": "null"}],
                                 "default": None, "title": "Occurred At"}


# The body is validated straight into the wire event (ingest/events.py), once, by its own rules.
class FeedbackRequest(FeedbackReceived):
    """What the product sends about one generation (`generation_id`), or its verdict on a
    whole agent session (`session_id`: every generation of it): exactly one of the two.
    `occurred_at` null or absent means when received."""

    model_config = ConfigDict(json_schema_extra=_document_inputs)

    @field_validator(*_SET_BY_THE_SERVER, mode="before")
    @classmethod
    def _server_value(cls, _: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None
        return cls.model_fields[info.field_name].get_default(call_default_factory=True)

    @field_validator("occurred_at", mode="before")
    @classmethod
    def _null_is_now(cls, value: Any) -> Any:
        return utcnow() if value is None else value


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
