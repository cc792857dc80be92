"""The inference routes over HTTP: OpenAI error shapes and limits, models, metrics, SSE framing,
and a client that disconnects mid-stream cancelling (and logging) its generation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.cli.stack import RunningStack, running_stack
from ingest.broker import EmbeddedBroker
from tests.app.api.helpers import CHAT, chat, check_disconnect_cancels
from tests.conftest import stack_settings

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(broker: EmbeddedBroker, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[RunningStack]:
    settings = stack_settings(broker, model_dir, tmp_path_factory.mktemp("api"),
                              max_body_bytes=16384, engine={"max_new_tokens_cap": 64})
    with running_stack(settings) as running:
        yield running


@pytest.fixture
def http(stack: RunningStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.base_url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("body, status, param, code", [
    (chat(max_tokens=65), 400, "max_tokens", "invalid_value"),
    (chat(max_tokens=0), 400, "max_tokens", "invalid_value"),
    (chat("x " * 2100), 400, "messages", "context_length_exceeded"),
    (chat("x " * 2000, max_tokens=64), 400, "messages", "context_length_exceeded"),
    (chat(temperature=3), 400, "temperature", "invalid_value"),
    (chat(model="gpt-4o"), 404, "model", "model_not_found"),
    ({"model": "flywheel", "messages": []}, 400, "messages", "invalid_value"),
    (chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", None),
])
def test_bad_requests_get_openai_errors(http: httpx.Client, body: dict, status: int,
                                        param: str, code: str | None) -> None:
    r = http.post(CHAT, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code", "request_id"}
    assert (error["param"], error["code"]) == (param, code)
    assert error["message"]


def test_oversized_body_is_413_with_the_limit(http: httpx.Client) -> None:
    r = http.post(CHAT, json=chat("y" * 20000))
    assert r.status_code == 413
    assert "16384" in r.json()["error"]["message"]


def test_prompt_token_ids_and_several_prompts(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": [[5, 6, 7], [8, 9]], "n": 2,
                                           "max_tokens": 3, "seed": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 5
    ids = r.headers["X-Flywheel-Generation-Ids"].split(",")
    assert ids == [c["generation_id"] for c in body["choices"]] and body["id"] == ids[0]


def test_stop_string_is_not_in_the_text(http: httpx.Client) -> None:
    first = http.post("/v1/completions", json={"prompt": "def", "max_tokens": 12,
                                               "temperature": 0}).json()["choices"][0]
    stop = first["text"][3:6]
    assert stop.strip(), first  # greedy text long enough to cut
    cut = http.post("/v1/completions", json={"prompt": "def", "max_tokens": 12,
                                             "temperature": 0, "stop": stop}).json()
    assert cut["choices"][0]["text"] == first["text"][:first["text"].index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_sse_framing_and_done(http: httpx.Client) -> None:
    with http.stream("POST", CHAT, json=chat(max_tokens=4, stream=True)) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert {c["id"] for c in chunks} == {r.headers["X-Flywheel-Generation-Id"]}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_models_and_metrics(http: httpx.Client) -> None:
    assert http.post(CHAT, json=chat(max_tokens=2)).status_code == 200
    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == "flywheel"
    assert http.get("/v1/models/nope").json()["error"]["code"] == "model_not_found"
    text = http.get("/metrics").text
    for name in ("flywheel_requests_total", "flywheel_completion_tokens_total",
                 "flywheel_request_latency_seconds_bucket", "flywheel_engine_batch_size_bucket",
                 "flywheel_session_log_queue_depth", "flywheel_session_log_spool_records"):
        assert name in text


def test_disconnect_cancels_and_logs_the_partial_generation(stack: RunningStack,
                                                            http: httpx.Client) -> None:
    check_disconnect_cancels(http, stack.kafka)


