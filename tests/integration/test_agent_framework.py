"""A real agent framework from the package index, the OpenAI Agents SDK, runs a coding task
against `flywheel up` through OpenAI function calling: its function tools reach the model
through the template, the model's calls come back as `tool_calls`, the SDK runs them on a
workspace and sends the results back as `tool` messages, until the task's tests pass."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from ingest.config import KafkaConfig
from ingest.events import GenerationLogged
from ingest.topic_reader import read_all
from simulate.rollouts import SYSTEM_PROMPT, SandboxCache, TaskEnvironment
from simulate.tasks import JsonlTasksConfig, build_task_source
from simulate.tools import TOOLS, ToolCall
from tests.conftest import flywheel_up, skilled_model

pytestmark = pytest.mark.integration


def test_openai_agents_sdk_solves_a_task_through_function_calling(
        model_dir: Path, tmp_path: Path) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    (tmp_path / "skill").mkdir()
    skilled = skilled_model(model_dir, tmp_path / "skill", steps=120)
    task = build_task_source(JsonlTasksConfig(path=skilled / "tasks.jsonl",
                                              held_out_fraction=1.0)).tasks()[0]
    env = TaskEnvironment(task, tmp_path / "workspace", SandboxCache())
    called: list[str] = []

    def run(call: ToolCall) -> str:
        called.append(call.name)
        (observation,), _ = env.step([call])
        return observation

    # the built-in agent's tools, written as an SDK user writes them: the signatures (with
    # the built-in descriptions, which the model was trained with) become the function tools
    # the model sees
    def read_file(path: str) -> str:
        return run(ToolCall("read_file", {"path": path}))

    def write_file(path: str, content: str) -> str:
        return run(ToolCall("write_file", {"path": path, "content": content}))

    def apply_edit(path: str, old: str, new: str) -> str:
        return run(ToolCall("apply_edit", {"path": path, "old": old, "new": new}))

    def run_tests() -> str:
        return run(ToolCall("run_tests"))

    def finish() -> str:
        return run(ToolCall("finish"))

    described = {t["function"]["name"]: t["function"]["description"] for t in TOOLS}
    tools = [function_tool(fn, description_override=described[fn.__name__])
             for fn in (read_file, write_file, apply_edit, run_tests, finish)]

    set_tracing_disabled(True)  # no trace export: nothing leaves this machine
    with flywheel_up(tmp_path / "data", skilled) as (url, kafka):
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="sdk", max_retries=0)
        agent = Agent(
            name="coder", instructions=SYSTEM_PROMPT,
            model=OpenAIChatCompletionsModel(model="flywheel", openai_client=client),
            model_settings=ModelSettings(temperature=0.0, max_tokens=64,
                                         extra_body={"session_id": "sdk-session"}),
            tools=tools,
            tool_use_behavior={"stop_at_tool_names": ["finish"]})
        result = asyncio.run(Runner.run(agent, task.starting_file, max_turns=6,
                                        run_config=RunConfig(tracing_disabled=True)))
        logged = wait_for_session(KafkaConfig(bootstrap=kafka), "sdk-session", len(called))

    assert called[0] in ("apply_edit", "write_file") and called[-1] == "finish", called
    assert env.test_result().status == "passed", (called, result.final_output)
    assert env.reward().value == 1.0
    # every model turn the SDK made is a logged generation of the session
    assert len(logged) >= len(called)


def wait_for_session(kafka: KafkaConfig, session_id: str, least: int,
                     timeout_s: float = 30.0) -> list[GenerationLogged]:
    deadline = time.monotonic() + timeout_s
    while True:
        got = [e for e in read_all(kafka, kafka.topics.sessions, GenerationLogged)
               if e.session_id == session_id]
        if len(got) >= least or time.monotonic() > deadline:
            return got
        time.sleep(0.5)
