"""OpenAI function calling through the official `openai` client on the torch engine: tools
reach the prompt, `required` and named `tool_choice` are enforced by the grammar, calls
round-trip through the conversation, streamed and non-streamed calls agree, bad tool input is
a 400 naming the field, and broken calls the model writes are content and counted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from app.api.completion_plan import GENERATION_HEADER
from app.cli.stack import RunningStack, running_stack
from ingest.broker import EmbeddedBroker
from ingest.events import ToolUse
from tests.app.api.helpers import (
    NAMED,
    TOOLS,
    USER,
    check_forced_tokens_logprobs,
    check_required_and_named_choices,
    check_streamed_calls_match,
    check_tools_reach_the_prompt,
    wait_for_sessions,
)
from tests.conftest import stack_settings

pytestmark = pytest.mark.integration


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
    raw = client.chat.completions.with_raw_response.create(
        model="flywheel", messages=USER, tools=TOOLS, tool_choice="required", seed=0,
        max_tokens=20)
    c = raw.parse().choices[0]
    assert c.finish_reason == "length" and c.message.tool_calls is None
    assert (c.message.content or "").startswith("<tool_call>")
    assert invalid() == before + 1
    # and the log says so, for the monitors; a call that parsed is logged as one
    cut = raw.headers[GENERATION_HEADER]
    whole = client.chat.completions.with_raw_response.create(
        model="flywheel", messages=USER, tools=TOOLS, tool_choice=NAMED, temperature=1.0, seed=0,
        max_tokens=128, parallel_tool_calls=False)
    made = whole.headers[GENERATION_HEADER]
    logged = wait_for_sessions(stack.kafka, {cut, made})
    assert logged[cut].tool_use == ToolUse(calls=0, invalid=1, question=False)
    assert logged[made].tool_use == ToolUse(calls=1, invalid=0, question=False)
