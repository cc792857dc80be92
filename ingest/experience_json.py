"""`ExperienceReady` as the join writes it: spliced JSON, not a pydantic dump per record.

A session judged several times yields several experiences that share most of their JSON
(tokens, logprobs, routes, sampling). `session_members` serializes that share once per
session; `experience_json` adds each feedback event's few fields around it. The result
decodes to what `encode(build_experience(...))` gives, up to member order
(tests/ingest/test_join.py checks both, and that SPLICED_FIELDS names every field).
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from typing import NamedTuple

from pydantic import TypeAdapter

from ingest.events import (
    EXPERIENCE_SCHEMA_VERSION,
    ExperienceReady,
    FeedbackReceived,
    GenerationLogged,
    encode,
    experience_id_for,
)


class Turn(NamedTuple):
    """Where a session verdict's experience sits in its session: turn `turn` (0-based, in
    generation order) of `turns`."""

    turn: int
    turns: int


def experience_id_of(feedback: FeedbackReceived, generation_id: str) -> str:
    """The experience id of `feedback` on `generation_id`: feedback about one generation
    yields one experience (its event id decides), a session verdict one per generation."""
    return experience_id_for(feedback.event_id,
                             generation_id if feedback.session_id is not None else None)


def build_experience(session: GenerationLogged, feedback: FeedbackReceived,
                     reward: float, turn: Turn | None = None) -> ExperienceReady:
    """The experience of `feedback` on `session`; `turn` for a session verdict's."""
    return ExperienceReady(
        experience_id=experience_id_of(feedback, session.generation_id),
        generation_id=session.generation_id, feedback_event_ids=[feedback.event_id],
        feedback_kind=feedback.kind, feedback_value=feedback.value,
        session_id=feedback.session_id, turn=turn.turn if turn else None,
        turns=turn.turns if turn else None, reward=reward,
        model_version=session.model_version, model_sha256=session.model_sha256,
        prompt_token_ids=session.prompt_token_ids,
        completion_token_ids=session.completion_token_ids, logprobs=session.logprobs,
        routed_experts=session.routed_experts, sampling=session.sampling,
        finish_reason=session.finish_reason, generated_at=session.created_at)


_SESSION_PART = {"model_version", "model_sha256", "prompt_token_ids", "completion_token_ids",
                 "logprobs", "routed_experts", "sampling", "finish_reason"}
_TIME = TypeAdapter(datetime)


def session_members(session: GenerationLogged) -> bytes:
    """The session's members of every ExperienceReady it yields, as JSON object members
    (`"model_version":…,"generated_at":…`), serialized once per session."""
    members = session.model_dump_json(include=_SESSION_PART)[1:-1]
    return members.encode() + b',"generated_at":' + _TIME.dump_json(session.created_at)


def joined_at_member(joined_at: datetime) -> bytes:
    return b',"joined_at":' + _TIME.dump_json(joined_at)


def experience_json(session: GenerationLogged, members: bytes, feedback: FeedbackReceived,
                    reward: float, joined: bytes, turn: Turn | None = None) -> bytes:
    """`encode(build_experience(session, feedback, reward, turn))` up to member order, from
    the session's pre-serialized members and `joined_at_member(...)`: only the feedback's few
    fields are serialized here. SPLICED_FIELDS must stay all of ExperienceReady's fields."""
    value = feedback.value
    if not math.isfinite(reward) or (value is not None and not math.isfinite(value)):
        return encode(build_experience(session, feedback, reward, turn))  # pydantic's rules
    string = _json_string
    session_id = feedback.session_id
    head = (f'{{"event":"ExperienceReady","schema_version":{EXPERIENCE_SCHEMA_VERSION},'
            f'"experience_id":{string(experience_id_of(feedback, session.generation_id))},'
            f'"generation_id":{string(session.generation_id)},'
            f'"feedback_event_ids":[{string(feedback.event_id)}],'
            f'"feedback_kind":{string(feedback.kind)},'
            f'"feedback_value":{"null" if value is None else float.__repr__(value)},'
            f'"session_id":{"null" if session_id is None else string(session_id)},'
            f'"turn":{"null" if turn is None else int(turn.turn)},'
            f'"turns":{"null" if turn is None else int(turn.turns)},'
            f'"reward":{float.__repr__(float(reward))},')
    return head.encode() + members + joined + b"}"


_json_string = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]  # C: '"…"'


SPLICED_FIELDS = {"event", "schema_version", "experience_id", "generation_id",
                  "feedback_event_ids", "feedback_kind", "feedback_value", "session_id",
                  "turn", "turns", "reward",
                  "generated_at", "joined_at", *_SESSION_PART}
