"""Checks of the HTTP API that run against either engine (the torch tests here, the vLLM backend's
in tests/integration/test_vllm_backend.py): chat completions, the official OpenAI client,
function calling."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from app.cli.stack import RunningStack
from ingest.config import KafkaConfig
from ingest.events import GenerationLogged
from ingest.topic_reader import read_all

CHAT = "/v1/chat/completions"


@contextmanager
def admin_client(stack: RunningStack) -> Iterator[httpx.Client]:
    """An HTTP client of `stack` carrying its admin token."""
    token = stack.settings.admin_secret().get_secret_value()
    with httpx.Client(base_url=stack.base_url, timeout=30,
                      headers={"Authorization": f"Bearer {token}"}) as client:
        yield client


def chat(content: str = "hi", **extra: object) -> dict[str, object]:
    return {"model": "flywheel", "messages": [{"role": "user", "content": content}], **extra}


def check_disconnect_cancels(http: httpx.Client, kafka: KafkaConfig) -> None:
    """A streaming client that goes away after one token: logged as cancelled, partial."""
    with http.stream("POST", CHAT, json=chat(max_tokens=64, stream=True)) as r:
        generation_id = r.headers["X-Flywheel-Generation-Id"]
        for line in r.iter_lines():
            if '"content":"' in line and '"role"' not in line:
                break  # one token seen; the client goes away
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        logged = [e for e in read_all(kafka, kafka.topics.sessions,
                                      GenerationLogged) if e.generation_id == generation_id]
        if logged:
            break
        time.sleep(0.2)
    assert [e.finish_reason for e in logged] == ["cancelled"]
    assert 1 <= len(logged[0].completion_token_ids) < 64


def wait_for_sessions(kafka: KafkaConfig, ids: set[str], timeout_s: float = 30.0
                      ) -> dict[str, GenerationLogged]:
    deadline = time.monotonic() + timeout_s
    while True:
        got = {e.generation_id: e for e in read_all(kafka, kafka.topics.sessions,
                                                    GenerationLogged)}
        if ids <= set(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


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


OPEN_FILE = {"type": "object", "properties": {
    "path": {"type": "string", "enum": ["solution.py", "tests/test_solution.py"]},
    "line": {"type": "integer", "minimum": 1, "maximum": 99},
    "fast": {"type": "boolean"}}, "required": ["path", "line"]}

TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "open_file", "description": "Open a file.",
                                      "parameters": OPEN_FILE}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the tests.",
                                      "parameters": {"type": "object", "properties": {}}}}]

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

USER = [{"role": "user", "content": "Open the solution, then run the tests."}]

NAMED: Any = {"type": "function", "function": {"name": "open_file"}}


def valid_call(call: Any) -> bool:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return True


# ---- checks both backends run (tests/integration/test_vllm_backend.py: the vLLM one) -----
def check_tools_reach_the_prompt(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model="flywheel", messages=USER, max_tokens=1)
    tooled = client.chat.completions.create(model="flywheel", messages=USER, max_tokens=1,
                                            tools=TOOLS)
    hidden = client.chat.completions.create(model="flywheel", messages=USER, max_tokens=1,
                                            tools=TOOLS, tool_choice="none")
    assert plain.usage and tooled.usage and hidden.usage
    assert tooled.usage.prompt_tokens > plain.usage.prompt_tokens + 30
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens  # "none" hides them


def check_required_and_named_choices(client: openai.OpenAI, requests: int) -> None:
    """An untrained model at temperature 1: every reply is a valid call. With parallel calls
    allowed it may start another and be cut by max_tokens (the cut one is content)."""
    for seed in range(requests):
        choice: Any = NAMED if seed % 3 == 0 else "required"
        parallel = seed % 3 == 2
        reply = client.chat.completions.create(
            model="flywheel", messages=USER, tools=TOOLS, tool_choice=choice, temperature=1.0,
            seed=seed, max_tokens=128, parallel_tool_calls=parallel)
        c = reply.choices[0]
        calls = c.message.tool_calls or []
        assert calls and all(valid_call(call) for call in calls), (seed, c.message)
        if not parallel:
            assert c.finish_reason == "tool_calls" and len(calls) == 1, (seed, c)
            assert c.message.content is None
        if choice is NAMED:
            assert [call.function.name for call in calls] == ["open_file"]


def check_streamed_calls_match(client: openai.OpenAI, seeds: tuple[int, ...]) -> None:
    ask = dict(model="flywheel", messages=USER, tools=TOOLS, tool_choice="required",
               temperature=1.0, max_tokens=128)
    for seed in seeds:
        whole = client.chat.completions.create(seed=seed, **ask).choices[0]  # type: ignore[call-overload]
        chunks = list(client.chat.completions.create(seed=seed, stream=True, **ask))  # type: ignore[call-overload]
        calls: dict[int, dict[str, str]] = {}
        pieces: dict[int, int] = {}
        for chunk in chunks:
            for delta in chunk.choices[0].delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                if delta.id:
                    assert not call["id"], "the id is sent once"
                    call["id"], call["name"] = delta.id, delta.function.name
                call["arguments"] += delta.function.arguments or ""
                pieces[delta.index] = pieces.get(delta.index, 0) + 1
        # parallel calls allowed: a second call may be cut by max_tokens (then "length")
        assert chunks[-1].choices[0].finish_reason == whole.finish_reason
        assert calls and [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        assert all(n >= 2 for n in pieces.values())  # the head, then arguments in pieces


def check_forced_tokens_logprobs(client: openai.OpenAI) -> None:
    """A forced token is logged under the masked distribution it was drawn from."""
    reply = client.chat.completions.create(
        model="flywheel", messages=USER, tools=TOOLS, seed=0, max_tokens=128, logprobs=True,
        top_logprobs=2, tool_choice={"type": "function", "function": {"name": "run_tests"}})
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) > 5
    # most of a no-argument call is forced syntax: one allowed token, probability exactly 1
    # under the masked distribution (an untrained model's own is about -7.5 here)
    forced = [t for t in content if t.logprob == 0.0]
    assert len(forced) >= len(content) / 4
    assert all(t.logprob > -5 for t in content)  # renormalized over the allowed tokens
    for t in forced:  # tokens the grammar masked (-inf) are no alternatives
        assert [a.logprob for a in t.top_logprobs] == [0.0]
