"""OpenAI function calling through the official `openai` client on the torch engine: tools
reach the prompt, `required` and named `tool_choice` are enforced by the grammar, calls
round-trip through the conversation, streamed and non-streamed calls agree, bad tool input is
a 400 naming the field, and broken calls the model writes are content and counted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from app.cli.stack import RunningStack, running_stack
from ingest.broker import EmbeddedBroker
from tests.conftest import stack_settings

pytestmark = pytest.mark.integration

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


@pytest.fixture(scope="module")
def stack(broker: EmbeddedBroker, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[RunningStack]:
    settings = stack_settings(broker, model_dir, tmp_path_factory.mktemp("tools"),
                              engine={"max_new_tokens_cap": 128})
    with running_stack(settings) as running:
        yield running


@pytest.fixture
def client(stack: RunningStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


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


def test_tools_reach_the_prompt(client: openai.OpenAI) -> None:
    check_tools_reach_the_prompt(client)


def test_required_and_named_choices_always_call_validly(client: openai.OpenAI) -> None:
    check_required_and_named_choices(client, requests=100)


def test_streamed_calls_assemble_to_the_non_streamed_reply(client: openai.OpenAI) -> None:
    check_streamed_calls_match(client, seeds=(3, 4, 5))


def test_forced_tokens_log_the_distribution_they_were_drawn_from(
        client: openai.OpenAI) -> None:
    check_forced_tokens_logprobs(client)


def test_a_conversation_with_calls_and_results_round_trips(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="flywheel", messages=USER, tools=TOOLS, seed=1, max_tokens=128, tool_choice=NAMED)
    call = (first.choices[0].message.tool_calls or [])[0]
    history = [*USER, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "def solve(x):\n    pass"}]
    second = client.chat.completions.create(model="flywheel", messages=history, tools=TOOLS,
                                            tool_choice="required", seed=2, max_tokens=128,
                                            parallel_tool_calls=False)
    assert second.usage and first.usage
    # the call and its result are in the prompt, in the template's words
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20
    assert second.choices[0].finish_reason == "tool_calls"
    free = client.chat.completions.create(model="flywheel", messages=history, tools=TOOLS,
                                          tool_choice="none", seed=2, max_tokens=16)
    assert free.choices[0].message.tool_calls is None  # none: text only
    assert free.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS * 65}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 80}
                                         for i in range(40)}}}}]}, "tools"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"not_an_openai_field": 1}, "not_an_openai_field"),
])
def test_bad_tool_input_is_400_naming_the_field(stack: RunningStack, extra: dict[str, Any],
                                                param: str) -> None:
    body = {"model": "flywheel", "messages": USER, **extra}
    r = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_tool_message_must_answer_an_earlier_call(stack: RunningStack) -> None:
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "run_tests",
                                                          "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_2", "content": "ok"}]
    r = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=30,
                   json={"model": "flywheel", "messages": messages, "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[2].tool_call_id"
    messages[1]["tool_calls"][0]["function"]["arguments"] = "not json"  # type: ignore[index]
    r = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=30,
                   json={"model": "flywheel", "messages": messages[:2], "tools": TOOLS})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


def test_a_call_cut_short_is_content_and_counted(client: openai.OpenAI,
                                                 stack: RunningStack) -> None:
    def invalid() -> float:
        text = httpx.get(f"{stack.base_url}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("flywheel_invalid_tool_calls_total{"))

    before = invalid()
    reply = client.chat.completions.create(model="flywheel", messages=USER, tools=TOOLS,
                                           tool_choice="required", seed=0, max_tokens=20)
    c = reply.choices[0]
    assert c.finish_reason == "length" and c.message.tool_calls is None
    assert (c.message.content or "").startswith("<tool_call>")
    assert invalid() == before + 1
