"""OpenAI function calling on the vLLM backend (`flywheel up` with
`FLYWHEEL_ENGINE__BACKEND=vllm`) through the official `openai` client: what
tests/app/test_tools.py checks on the torch engine, where the grammar is vLLM's structured
outputs instead of the torch engine's mask. Tools reach the prompt, `required` and named
`tool_choice` always give valid calls, streamed calls assemble to the non-streamed reply,
`none` gives text, and forced tokens log the masked distribution they were drawn from.

One `flywheel up` serves the module. Skips with a reason where vLLM is not installed; fails
instead when CI=true, where it must run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.app.test_tools import (
    TOOLS,
    USER,
    check_forced_tokens_logprobs,
    check_required_and_named_choices,
    check_streamed_calls_match,
    check_tools_reach_the_prompt,
)
from tests.conftest import flywheel_up
from tests.integration.test_vllm_backend import require_vllm

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[openai.OpenAI]:
    require_vllm()
    with flywheel_up(tmp_path_factory.mktemp("vllm-tools"), model_dir,
                     FLYWHEEL_ENGINE__BACKEND="vllm") as (url, _kafka):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_tools_reach_the_prompt(client: openai.OpenAI) -> None:
    check_tools_reach_the_prompt(client)


def test_required_and_named_choices_always_call_validly(client: openai.OpenAI) -> None:
    check_required_and_named_choices(client, requests=20)


def test_streamed_calls_assemble_to_the_non_streamed_reply(client: openai.OpenAI) -> None:
    check_streamed_calls_match(client, seeds=(3, 4))


def test_tool_choice_none_answers_in_text(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="flywheel", messages=USER, tools=TOOLS,
                                           tool_choice="none", seed=2, max_tokens=16)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_forced_tokens_log_the_distribution_they_were_drawn_from(
        client: openai.OpenAI) -> None:
    """vLLM masks the logits before its sampler, so its processed logprobs are the masked
    distribution's, as the torch engine's (serving/vllm_engine.py says so)."""
    check_forced_tokens_logprobs(client)
