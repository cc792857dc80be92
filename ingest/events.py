"""Wire types: every record Flywheel puts on Kafka, versioned, as JSON.

Invariants (checked on decode, so a consumer never sees a record that breaks them):
- Numeric arrays travel as `PackedArray`: little-endian bytes, base64, with dtype and shape;
  never as JSON lists of floats.
- `GenerationLogged`: `logprobs` has the length of `completion_token_ids`; `routed_experts`,
  when present, has shape (P + T - 1, moe_layers, top_k): one row per position that went
  through the model (the last sampled token is never fed back). Without them,
  `routes_absent` may say why (a backend that cannot capture routes); the trainer then
  recomputes that record without router replay. Version 1 records have no `routes_absent`.
- `FeedbackReceived.event_id` is the idempotency key; `edit_kept` carries the kept fraction.
  It judges one generation (`generation_id`) or one whole agent session (`session_id`, a
  verdict): exactly one of the two is set, and it is the record's key (`key`). Version 1
  records (before session verdicts) have a generation_id and no session_id.
- `ExperienceReady.session_id`, `turn` and `turns` are all set (an experience of a session
  verdict: turn k of T, 0 <= k < T) or all None (feedback about one generation); version 1
  records have none of them.
- Every record carries `schema_version`, per type; a consumer rejects versions it does not
  know (DLQ) and decodes every older version it lists.

The rollout fleet's records (`RolloutJob`, `RolloutGroup`) are in `ingest/rollout_events.py`.

Topics and keys: sessions keyed by generation_id, feedback by generation_id or session_id
(`FeedbackReceived.key`), experiences by experience_id, rollout-jobs and rollouts by job_id,
releases and policy (policy versions, as `ReleasePublished`) by version, dlq keyed by the
original key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, Final, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SCHEMA_VERSION: Final = 1  # the types still at their first version
FEEDBACK_SCHEMA_VERSION: Final = 2  # 2: session verdicts (session_id)
EXPERIENCE_SCHEMA_VERSION: Final = 2  # 2: session_id, turn, turns
GENERATION_SCHEMA_VERSION: Final = 2  # 2: routes_absent
DType = Literal["int16", "int32", "int64", "float32", "uint8"]


def utcnow() -> datetime:
    return datetime.now(UTC)


class EventDecodeError(ValueError):
    """Raw bytes that are not a valid record of the expected type; the message says why."""


class PackedArray(BaseModel):
    """An n-d numeric array as little-endian bytes in base64."""

    model_config = ConfigDict(frozen=True)

    dtype: DType
    shape: tuple[int, ...]
    data: str

    @classmethod
    def pack(cls, values: np.ndarray | Sequence[Any], dtype: DType) -> PackedArray:
        array = np.asarray(values, dtype=np.dtype(dtype).newbyteorder("<"), order="C")
        return cls(dtype=dtype, shape=tuple(array.shape),
                   data=base64.b64encode(array.tobytes()).decode("ascii"))

    def unpack(self) -> np.ndarray:
        raw = base64.b64decode(self.data)
        return np.frombuffer(raw, dtype=np.dtype(self.dtype).newbyteorder("<")).reshape(self.shape)

    def tolist(self) -> list[Any]:
        return self.unpack().tolist()

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1

    @model_validator(mode="after")
    def _size_matches_shape(self) -> PackedArray:
        if any(side < 0 for side in self.shape):
            raise ValueError(f"shape {list(self.shape)} has a negative side")
        try:  # strict: every character in the alphabet, padding only at the end
            actual = len(binascii.a2b_base64(self.data, strict_mode=True))
        except binascii.Error as exc:
            raise ValueError(f"data is not base64: {exc}") from exc
        expected = math.prod(self.shape) * np.dtype(self.dtype).itemsize
        if actual != expected:
            raise ValueError(f"packed {self.dtype}{list(self.shape)} needs {expected} bytes, "
                             f"got {actual}")
        return self


class SamplingParams(BaseModel):
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(default=64, ge=1)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)


class ToolUse(BaseModel):
    """What a generation offered tools did with them, as the server parsed it: the calls it
    made, the call blocks it botched (unparseable, an unknown tool, arguments off the schema),
    and whether a reply without calls ended in a question (asking instead of acting). The
    monitors of trainer/release/monitors.py count these per version."""

    calls: int = Field(default=0, ge=0)
    invalid: int = Field(default=0, ge=0)
    question: bool = False


class GenerationLogged(BaseModel):
    """One completion exactly as served: the trainer can recompute it token for token."""

    event: Literal["GenerationLogged"] = "GenerationLogged"
    schema_version: Literal[1, 2] = GENERATION_SCHEMA_VERSION
    generation_id: str = Field(min_length=1, max_length=128)
    request_id: str = Field(min_length=1, max_length=128)
    model_version: int = Field(ge=0)
    model_sha256: str
    created_at: datetime = Field(default_factory=utcnow)
    session_id: str | None = None
    user_id: str | None = None
    prompt_token_ids: PackedArray
    completion_token_ids: PackedArray
    logprobs: PackedArray
    routed_experts: PackedArray | None = None
    routes_absent: str | None = Field(default=None, max_length=500)
    sampling: SamplingParams
    finish_reason: Literal["stop", "length", "cancelled"]
    latency_ms: float = Field(ge=0.0)
    tool_use: ToolUse | None = None  # None: no tools were offered

    @model_validator(mode="after")
    def _aligned(self) -> GenerationLogged:
        t = len(self.completion_token_ids)
        if len(self.logprobs) != t:
            raise ValueError(f"logprobs has {len(self.logprobs)} entries for {t} tokens")
        if self.routed_experts is not None:
            rows = len(self.prompt_token_ids) + t - 1
            if len(self.routed_experts.shape) != 3 or self.routed_experts.shape[0] != rows:
                raise ValueError(f"routed_experts shape {list(self.routed_experts.shape)} "
                                 f"needs ({rows}, layers, top_k)")
            if self.routes_absent is not None:
                raise ValueError("routes_absent is set but routed_experts are present")
        if self.schema_version == 1 and self.routes_absent is not None:
            raise ValueError("schema_version 1 has no routes_absent: send version 2")
        return self


FeedbackKind = Literal["accept", "reject", "thumbs_up", "thumbs_down", "edit_kept",
                       "followup_dissatisfied", "copied", "regenerated"]


# A generation served in privacy mode has an id of this prefix, and nothing else of it is
# written anywhere (not to `sessions`): feedback about it is refused by its id alone
PRIVATE_GENERATION_PREFIX = "genp-"


def is_private_generation(generation_id: str | None) -> bool:
    return generation_id is not None and generation_id.startswith(PRIVATE_GENERATION_PREFIX)


def check_feedback_subject(generation_id: str | None, session_id: str | None) -> None:
    """Feedback is about one generation or a whole session: exactly one (ValueError)."""
    if (generation_id is None) == (session_id is None):
        given = "both" if generation_id is not None else "neither"
        raise ValueError("give exactly one of generation_id (feedback about one generation) "
                         f"and session_id (a verdict on a whole session), not {given}")


def check_feedback_value(kind: FeedbackKind, value: float | None) -> None:
    """`edit_kept` carries the kept fraction in [0, 1] (ValueError)."""
    if kind == "edit_kept" and (value is None or not 0.0 <= value <= 1.0):
        raise ValueError("edit_kept needs value: the kept fraction in [0, 1]")


class FeedbackReceived(BaseModel):
    """A user's judgment, as the product reported it: of one generation (`generation_id`), or
    a verdict on one whole agent session (`session_id`, every generation that carries it)."""

    event: Literal["FeedbackReceived"] = "FeedbackReceived"
    schema_version: Literal[1, 2] = FEEDBACK_SCHEMA_VERSION
    event_id: Annotated[str, Field(min_length=1, max_length=128)]
    generation_id: Annotated[str | None, Field(min_length=1, max_length=128)] = None
    session_id: Annotated[str | None, Field(min_length=1, max_length=128)] = None
    kind: FeedbackKind
    value: float | None = Field(default=None, strict=True, allow_inf_nan=False)  # a number
    occurred_at: datetime = Field(default_factory=utcnow)
    received_at: datetime = Field(default_factory=utcnow)
    source: str = Field(default="api", max_length=64)

    @model_validator(mode="after")
    def _one_subject(self) -> FeedbackReceived:
        check_feedback_subject(self.generation_id, self.session_id)
        if self.schema_version == 1 and self.session_id is not None:
            raise ValueError("schema_version 1 has no session_id: send version 2")
        return self

    @model_validator(mode="after")
    def _value_fits_kind(self) -> FeedbackReceived:
        check_feedback_value(self.kind, self.value)
        return self

    @property
    def key(self) -> str:
        """The record's key on `feedback`, which also picks its partition: the generation_id,
        or for a session verdict the session_id."""
        key = self.generation_id if self.generation_id is not None else self.session_id
        assert key is not None  # `_one_subject` guarantees one of them
        return key


class ExperienceReady(BaseModel):
    """One generation joined with one feedback event: the tokens as served and their reward.

    `experience_id` derives from the feedback event id, and for a session verdict from the
    generation id too (`experience_id_for`), so a re-produced record after a crash carries the
    same key and downstream dedupes on it. A session verdict yields one experience per turn:
    `session_id`, `turn` (0-based, in the order the turns were generated) and `turns` say
    which; all three are None for feedback about one generation. Arrays follow
    `GenerationLogged`: `logprobs` (behavior policy) has the length of `completion_token_ids`;
    `routed_experts`, when present, has shape (P + T - 1, moe_layers, top_k).
    """

    event: Literal["ExperienceReady"] = "ExperienceReady"
    schema_version: Literal[1, 2] = EXPERIENCE_SCHEMA_VERSION
    experience_id: str = Field(min_length=1, max_length=128)
    generation_id: str = Field(min_length=1, max_length=128)
    feedback_event_ids: list[str] = Field(min_length=1)
    feedback_kind: FeedbackKind
    feedback_value: float | None = None
    session_id: str | None = Field(default=None, min_length=1, max_length=128)
    turn: int | None = Field(default=None, ge=0)
    turns: int | None = Field(default=None, ge=1)
    # the generation's user (None: none was given, or a record from before this field):
    # by it the trainer skips a deleted user's experiences (ingest.deletions)
    user_id: str | None = None
    reward: float
    model_version: int = Field(ge=0)
    model_sha256: str
    prompt_token_ids: PackedArray
    completion_token_ids: PackedArray
    logprobs: PackedArray
    routed_experts: PackedArray | None = None
    sampling: SamplingParams
    finish_reason: Literal["stop", "length", "cancelled"]
    generated_at: datetime
    joined_at: datetime = Field(default_factory=utcnow)

    @classmethod
    def of(cls, session: GenerationLogged, feedback: FeedbackReceived, reward: float, *,
           turn: int | None = None, turns: int | None = None) -> ExperienceReady:
        """The experience of `feedback` on `session` (a session verdict's: turn `turn` of
        `turns`). Built without validating again what the two events validated already."""
        verdict = feedback.session_id is not None
        return cls.model_construct(
            experience_id=experience_id_for(
                feedback.event_id, session.generation_id if verdict else None),
            generation_id=session.generation_id, feedback_event_ids=[feedback.event_id],
            feedback_kind=feedback.kind, feedback_value=feedback.value,
            session_id=feedback.session_id, turn=turn, turns=turns, user_id=session.user_id,
            reward=float(reward),
            model_version=session.model_version, model_sha256=session.model_sha256,
            prompt_token_ids=session.prompt_token_ids,
            completion_token_ids=session.completion_token_ids, logprobs=session.logprobs,
            routed_experts=session.routed_experts, sampling=session.sampling,
            finish_reason=session.finish_reason, generated_at=session.created_at,
            joined_at=utcnow())

    @model_validator(mode="after")
    def _aligned(self) -> ExperienceReady:
        t = len(self.completion_token_ids)
        if len(self.logprobs) != t:
            raise ValueError(f"logprobs has {len(self.logprobs)} entries for {t} tokens")
        return self

    @model_validator(mode="after")
    def _turn_of_a_session(self) -> ExperienceReady:
        given = [x is not None for x in (self.session_id, self.turn, self.turns)]
        if any(given) and not all(given):
            raise ValueError("session_id, turn and turns go together (a session verdict's "
                             "experience) or are all null")
        if self.turn is not None and self.turns is not None and self.turn >= self.turns:
            raise ValueError(f"turn {self.turn} is not one of the session's {self.turns}")
        if self.schema_version == 1 and any(given):
            raise ValueError("schema_version 1 has no session_id, turn or turns")
        return self


def experience_id_for(event_id: str, generation_id: str | None = None) -> str:
    """The id of the experience a feedback event yields (stable across runs): from the event
    id alone for feedback about one generation (its only experience), from the event id and
    the generation for a session verdict (one experience per generation of the session)."""
    if generation_id is None:
        return "exp-" + hashlib.sha256(event_id.encode("utf-8")).hexdigest()[:32]
    pair = json.dumps([event_id, generation_id]).encode("utf-8")  # unambiguous, unlike a join
    return "exp-" + hashlib.sha256(pair).hexdigest()[:32]


class DeadLetter(BaseModel):
    """A record a consumer could not use, kept whole with the reason."""

    event: Literal["DeadLetter"] = "DeadLetter"
    schema_version: Literal[1] = SCHEMA_VERSION
    topic: str
    partition: int | None = None
    offset: int | None = None
    key_b64: str | None = None
    raw_b64: str
    reason: str
    consumer: str
    failed_at: datetime = Field(default_factory=utcnow)

    @classmethod
    def of(cls, *, topic: str, raw: bytes, key: bytes | None, reason: str, consumer: str,
           partition: int | None = None, offset: int | None = None) -> DeadLetter:
        return cls(topic=topic, partition=partition, offset=offset, reason=reason,
                   consumer=consumer, raw_b64=base64.b64encode(raw).decode("ascii"),
                   key_b64=base64.b64encode(key).decode("ascii") if key is not None else None)

    def raw(self) -> bytes:
        return base64.b64decode(self.raw_b64)


ReleaseKind = Literal["delta", "snapshot", "rollback"]


class ReleasePublished(BaseModel):
    """A version every serving replica should serve next, keyed by version on `releases`.

    `manifest_uri` names the delta that takes `parent` to `version` (for kind rollback: the
    delta of the rolled-back release, applied backwards, since XOR is its own inverse); a
    snapshot also carries `snapshot_uri`, the full weights that reset the chain (version 0 has
    only that). `sha256` is the whole-model hash
    (`kernels.weights.state_dict_sha256`) a replica must reach; replicas apply releases in
    `published_at` order and ignore older ones.
    """

    event: Literal["ReleasePublished"] = "ReleasePublished"
    schema_version: Literal[1] = SCHEMA_VERSION
    version: int = Field(ge=0)
    parent: int | None = Field(default=None, ge=0)
    kind: ReleaseKind
    manifest_uri: str = Field(min_length=1)
    snapshot_uri: str | None = None  # set on snapshots: the full weights, for far-behind replicas
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    eval_summary: dict[str, float] = Field(default_factory=dict)
    # set: a canary, served beside its parent to this share of sessions (by session id)
    # until an announcement of the same version without it (promoted) or of the parent
    # (rolled back); None: every session's version (serving/canary.py)
    canary_share: float | None = Field(default=None, gt=0.0, lt=1.0)
    published_at: datetime = Field(default_factory=utcnow)

    @model_validator(mode="after")
    def _parent_fits_kind(self) -> ReleasePublished:
        if self.kind != "snapshot" and self.parent is None:
            raise ValueError(f"a {self.kind} release needs its parent version")
        if self.kind == "snapshot" and self.snapshot_uri is None:
            raise ValueError("a snapshot release needs snapshot_uri")
        if self.canary_share is not None and (self.kind == "rollback" or self.parent is None):
            raise ValueError("a canary is a new release served beside its parent")
        return self


E = TypeVar("E", bound=BaseModel)


def encode(event: BaseModel) -> bytes:
    return event.model_dump_json().encode("utf-8")


def decode(event_type: type[E], raw: bytes) -> E:
    """Parse `raw` as `event_type`; the error names the offending field."""
    try:
        return event_type.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "<record>"
        raise EventDecodeError(f"{event_type.__name__}: {where}: {first['msg']}") from exc
