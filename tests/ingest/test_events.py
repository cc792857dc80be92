"""Wire types: packed arrays round-trip exactly, invariants hold, the schema changes on purpose."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ingest.events import (
    DeadLetter,
    EventDecodeError,
    ExperienceReady,
    FeedbackReceived,
    GenerationLogged,
    PackedArray,
    SamplingParams,
    decode,
    encode,
    experience_id_for,
)

SNAPSHOT = Path(__file__).parents[1] / "snapshots" / "event_schemas.json"


def generation(**overrides: object) -> GenerationLogged:
    fields: dict[str, object] = dict(
        generation_id="gen-1", request_id="gen-1", model_version=3, model_sha256="ab" * 32,
        prompt_token_ids=PackedArray.pack([5, 6, 7], "int32"),
        completion_token_ids=PackedArray.pack([8, 9], "int32"),
        logprobs=PackedArray.pack([-0.25, -1.5], "float32"),
        routed_experts=PackedArray.pack(np.arange(4 * 2 * 2).reshape(4, 2, 2), "int16"),
        sampling=SamplingParams(temperature=0.7, max_tokens=2), finish_reason="length",
        latency_ms=12.5)
    fields.update(overrides)
    return GenerationLogged(**fields)  # type: ignore[arg-type]


def test_packed_array_round_trips_bits_exactly() -> None:
    values = np.array([-0.0, 1e-38, -3.4e38, np.inf, 0.1], dtype=np.float32)
    back = PackedArray.pack(values, "float32").unpack()
    assert back.tobytes() == values.tobytes()
    grid = np.arange(24, dtype=np.int16).reshape(2, 3, 4)
    assert np.array_equal(PackedArray.pack(grid, "int16").unpack(), grid)


def test_packed_array_is_not_a_json_float_list() -> None:
    raw = json.loads(encode(generation()))
    assert isinstance(raw["logprobs"]["data"], str)
    assert raw["logprobs"] == {"dtype": "float32", "shape": [2], "data": raw["logprobs"]["data"]}


def test_generation_round_trip() -> None:
    event = generation()
    back = decode(GenerationLogged, encode(event))
    assert back == event
    assert back.logprobs.tolist() == [-0.25, -1.5]


def test_packed_size_must_match_shape() -> None:
    good = PackedArray.pack([1, 2, 3], "int32")
    with pytest.raises(ValueError, match="needs 16 bytes"):
        PackedArray(dtype="int32", shape=(4,), data=good.data)


def test_logprobs_must_align_with_tokens() -> None:
    with pytest.raises(ValueError, match="logprobs has 1 entries for 2 tokens"):
        generation(logprobs=PackedArray.pack([-1.0], "float32"))


def test_routes_cover_every_position_fed_to_the_model() -> None:
    with pytest.raises(ValueError, match=r"needs \(4, layers, top_k\)"):
        generation(routed_experts=PackedArray.pack(np.zeros((5, 2, 2)), "int16"))


def test_feedback_edit_kept_needs_fraction() -> None:
    with pytest.raises(ValueError, match="kept fraction"):
        FeedbackReceived(event_id="e", generation_id="g", kind="edit_kept")
    ok = FeedbackReceived(event_id="e", generation_id="g", kind="edit_kept", value=0.4)
    assert decode(FeedbackReceived, encode(ok)) == ok


def test_feedback_judges_one_generation_or_one_session() -> None:
    verdict = FeedbackReceived(event_id="e", session_id="s", kind="reject")
    assert (verdict.key, verdict.generation_id, verdict.schema_version) == ("s", None, 2)
    assert decode(FeedbackReceived, encode(verdict)) == verdict
    assert FeedbackReceived(event_id="e", generation_id="g", kind="accept").key == "g"
    for subject, word in (({"generation_id": "g", "session_id": "s"}, "both"), ({}, "neither")):
        with pytest.raises(ValueError, match=f"exactly one of generation_id .* not {word}"):
            FeedbackReceived(event_id="e", kind="accept", **subject)  # type: ignore[arg-type]


# records as version 1 wrote them, before session verdicts: they still decode
V1_FEEDBACK = (b'{"event":"FeedbackReceived","schema_version":1,"event_id":"evt-1",'
               b'"generation_id":"gen-1","kind":"edit_kept","value":0.5,'
               b'"occurred_at":"2026-01-02T03:04:05Z","received_at":"2026-01-02T03:04:06Z",'
               b'"source":"api"}')


def v1_experience() -> bytes:
    g = generation()
    return json.dumps({
        "event": "ExperienceReady", "schema_version": 1,
        "experience_id": experience_id_for("evt-1"), "generation_id": "gen-1",
        "feedback_event_ids": ["evt-1"], "feedback_kind": "accept", "feedback_value": None,
        "reward": 1.0, "model_version": 3, "model_sha256": "ab" * 32,
        "prompt_token_ids": g.prompt_token_ids.model_dump(),
        "completion_token_ids": g.completion_token_ids.model_dump(),
        "logprobs": g.logprobs.model_dump(), "routed_experts": None,
        "sampling": g.sampling.model_dump(), "finish_reason": "length",
        "generated_at": "2026-01-02T03:04:05Z", "joined_at": "2026-01-02T03:04:07Z"}).encode()


def test_version_1_records_still_decode() -> None:
    feedback = decode(FeedbackReceived, V1_FEEDBACK)
    assert (feedback.schema_version, feedback.generation_id, feedback.session_id,
            feedback.key, feedback.value) == (1, "gen-1", None, "gen-1", 0.5)
    experience = decode(ExperienceReady, v1_experience())
    assert experience.schema_version == 1 and experience.generation_id == "gen-1"
    assert (experience.session_id, experience.turn, experience.turns) == (None, None, None)
    assert experience.logprobs.tolist() == [-0.25, -1.5]
    # version 1 had no session verdicts: a record that claims one is refused
    with pytest.raises(EventDecodeError, match="schema_version 1 has no session_id"):
        decode(FeedbackReceived, V1_FEEDBACK.replace(b'"generation_id":"gen-1"',
                                                     b'"session_id":"s-1"'))


def test_generation_says_why_its_routes_are_absent() -> None:
    reason = "vllm on CPU returns no routed experts"
    event = generation(routed_experts=None, routes_absent=reason)
    assert decode(GenerationLogged, encode(event)).routes_absent == reason
    with pytest.raises(ValueError, match="routes_absent is set but routed_experts"):
        generation(routes_absent=reason)
    raw = json.loads(encode(generation()))  # a version 1 record: no routes_absent
    raw["schema_version"] = 1
    del raw["routes_absent"]
    assert decode(GenerationLogged, json.dumps(raw).encode()).schema_version == 1
    with pytest.raises(EventDecodeError, match="schema_version 1 has no routes_absent"):
        decode(GenerationLogged, json.dumps({**raw, "routed_experts": None,
                                             "routes_absent": reason}).encode())


def test_experience_turns_go_together() -> None:
    raw = json.loads(v1_experience())
    raw["schema_version"] = 2
    ok = decode(ExperienceReady, json.dumps({**raw, "session_id": "s", "turn": 2,
                                             "turns": 3}).encode())
    assert (ok.session_id, ok.turn, ok.turns) == ("s", 2, 3)
    with pytest.raises(EventDecodeError, match="go together"):
        decode(ExperienceReady, json.dumps({**raw, "session_id": "s"}).encode())
    with pytest.raises(EventDecodeError, match="turn 3 is not one of the session's 3"):
        decode(ExperienceReady, json.dumps({**raw, "session_id": "s", "turn": 3,
                                            "turns": 3}).encode())


def test_a_verdict_has_one_experience_id_per_generation() -> None:
    assert experience_id_for("e") != experience_id_for("e", "g1") != experience_id_for("e", "g2")
    assert experience_id_for("e", "g1") == experience_id_for("e", "g1")  # stable
    assert experience_id_for("a", "bc") != experience_id_for("ab", "c")  # no ambiguous join


def test_decode_error_names_the_field() -> None:
    with pytest.raises(EventDecodeError, match="kind"):
        decode(FeedbackReceived, b'{"event_id": "e", "generation_id": "g", "kind": "meh"}')
    with pytest.raises(EventDecodeError):
        decode(FeedbackReceived, b"\x00not json")


def test_unknown_schema_version_is_rejected() -> None:
    raw = json.loads(encode(generation()))
    raw["schema_version"] = 99
    with pytest.raises(EventDecodeError, match="schema_version"):
        decode(GenerationLogged, json.dumps(raw).encode())


def test_dead_letter_keeps_raw_bytes() -> None:
    letter = DeadLetter.of(topic="feedback", raw=b"\xff\x00", key=b"k", reason="bad",
                           consumer="join", partition=1, offset=7)
    assert decode(DeadLetter, encode(letter)).raw() == b"\xff\x00"


def current_schemas() -> dict[str, object]:
    from ingest import events, rollout_events

    types = [events.GenerationLogged, events.FeedbackReceived, events.DeadLetter,
             events.ExperienceReady, events.ReleasePublished, rollout_events.RolloutGroup]
    return {t.__name__: t.model_json_schema() for t in types}


def test_schema_snapshot() -> None:
    """Wire schemas change on purpose: regenerate with `python -m tests.ingest.test_events`."""
    assert SNAPSHOT.exists(), "run `python -m tests.ingest.test_events` to write the snapshot"
    assert json.loads(SNAPSHOT.read_text()) == current_schemas()


if __name__ == "__main__":
    SNAPSHOT.write_text(json.dumps(current_schemas(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}")


# ---- property-based: packed arrays from the wire ------------------------------------------
import base64  # noqa: E402

from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402
from pydantic import ValidationError  # noqa: E402

_DTYPES = st.sampled_from(["int16", "int32", "float32"])


@given(dtype=_DTYPES, data=st.data())
def test_any_array_round_trips_exactly(dtype: str, data: st.DataObject) -> None:
    array = data.draw(hnp.arrays(dtype, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0,
                                                         max_side=5)))
    packed = PackedArray.model_validate_json(PackedArray.pack(array, dtype).model_dump_json())
    assert packed.unpack().tobytes() == array.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    assert packed.unpack().shape == array.shape


@given(dtype=st.one_of(_DTYPES, st.text(max_size=8)),
       shape=st.lists(st.integers(min_value=-(2**70), max_value=2**70), max_size=4),
       payload=st.one_of(st.text(max_size=40), st.binary(max_size=30).map(
           lambda b: base64.b64encode(b).decode())))
@example(dtype="int16", shape=[-1, -2], payload="AAAAAA==")  # passed, then failed to unpack
@example(dtype="int16", shape=[3], payload="!!!!!!!!")  # as was this (not base64)
def test_any_wire_value_is_an_array_or_a_validation_error(dtype: str, shape: list[int],
                                                           payload: str) -> None:
    try:
        packed = PackedArray.model_validate({"dtype": dtype, "shape": shape, "data": payload})
    except ValidationError:
        return
    assert packed.unpack().shape == tuple(shape)
