"""The official `openai` client, unmodified, against the running stack: sync and streaming,
chat and completions; every choice it received is a logged generation."""

from __future__ import annotations

import time

import openai
import pytest

from app.cli.stack import running_stack
from app.settings import Settings
from ingest.config import KafkaConfig
from ingest.events import GenerationLogged
from ingest.log import read_all

pytestmark = pytest.mark.integration


def wait_for_sessions(kafka: KafkaConfig, ids: set[str], timeout_s: float = 30.0
                      ) -> dict[str, GenerationLogged]:
    deadline = time.monotonic() + timeout_s
    while True:
        got = {e.generation_id: e for e in read_all(kafka, kafka.topics.sessions,
                                                    GenerationLogged)}
        if ids <= set(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_openai_client_chat_and_completions(settings: Settings) -> None:
    with running_stack(settings) as stack:
        check_openai_client(stack.base_url, stack.kafka)


def check_openai_client(base_url: str, kafka: KafkaConfig, *,
                        routes_absent: str | None = None) -> None:
    """The client's calls against a served stack, and what the session log holds of them;
    `routes_absent`: the backend logs no routes, and says this."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "def add(a, b):"}]

    raw = client.chat.completions.with_raw_response.create(
        model="flywheel", messages=messages, max_tokens=8, seed=7, n=2, logprobs=True,
        top_logprobs=3)
    chat = raw.parse()
    assert raw.headers["x-flywheel-generation-id"] == chat.id
    ids = raw.headers["x-flywheel-generation-ids"].split(",")
    assert ids[0] == chat.id and len(set(ids)) == 2
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.usage is not None and chat.usage.completion_tokens == sum(
        len(c.logprobs.content) for c in chat.choices)  # type: ignore[union-attr]
    for c in chat.choices:
        assert len(c.logprobs.content[0].top_logprobs) == 3  # type: ignore[union-attr]
        exact = b"".join(bytes(t.bytes) for t in c.logprobs.content)  # type: ignore[union-attr, misc]
        assert exact.decode("utf-8", "replace") == c.message.content

    chunks = list(client.chat.completions.create(
        model="flywheel", messages=messages, max_tokens=8, seed=7, stream=True,
        stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content  # same seed, same tokens
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(
        chat.choices[0].logprobs.content)  # type: ignore[union-attr]

    completion = client.completions.create(model="flywheel", prompt="def is_even(n):",
                                           max_tokens=6, temperature=0, logprobs=2)
    assert completion.system_fingerprint == chat.system_fingerprint
    pieces = list(client.completions.create(model="flywheel", prompt="def is_even(n):",
                                            max_tokens=6, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == completion.choices[0].text
    assert pieces[-1].choices[0].finish_reason == completion.choices[0].finish_reason

    models = client.models.list()
    assert [m.id for m in models.data] == ["flywheel"]
    served = ids + [chunks[0].id, completion.id, pieces[0].id]
    logged = wait_for_sessions(kafka, set(served))

    assert set(served) <= set(logged)
    first, second = logged[ids[0]], logged[ids[1]]
    assert first.request_id == second.request_id  # n = 2: two generations, one request
    assert first.completion_token_ids.tolist() != second.completion_token_ids.tolist()
    for choice, gen_id in zip(chat.choices, ids, strict=True):
        event = logged[gen_id]
        assert event.logprobs.unpack().tolist() == pytest.approx(
            [t.logprob for t in choice.logprobs.content])  # type: ignore[union-attr]
        if routes_absent is None:
            assert event.routed_experts is not None and event.routes_absent is None
        else:
            assert event.routed_experts is None and routes_absent in (event.routes_absent or "")
        assert chat.system_fingerprint == f"fw-v{event.model_version}-{event.model_sha256[:12]}"
    assert logged[completion.id].sampling.temperature == 0.0
