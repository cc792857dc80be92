"""The built-in harness as an agent program: `python -m simulate.builtin_agent`.

What a product's agent does under the contract of `simulate.agents`, done by Flywheel's own
multi-turn harness over the OpenAI API (`simulate.developers.ChatTurns`, the official client,
function calling): it reads the task and the job's sampling from its environment, works the
workspace with the built-in tools (the tests through the local sandbox), judges its session by
the task's tests as a simulated developer does (`simulate.developers.verdict`), reports that
verdict signed to the feedback URL, and exits 0. The bootstrap's default rollouts run the same
harness in the worker's process on token ids (`simulate.harness.EngineTurns`): this program is
how the fleet runs it as any other agent (`flywheel bootstrap --agent builtin`).
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import sys
from collections.abc import Mapping
from pathlib import Path

import httpx
import openai

from ingest.rollout_events import RolloutSampling
from simulate.developers import ChatTurns, session_verdict, verdict
from simulate.harness import Harness, HarnessConfig, Sampling
from simulate.rollouts import SandboxCache, TaskEnvironment
from simulate.tasks import Task
from simulate.tools import TOOLS
from simulate.zygote import warm_zygote

# one TLS context for every client this process opens (each episode's, forked from a warm
# host): building one loads the CA bundle, about 17 ms of CPU, and an episode opens two
TLS = ssl.create_default_context()


def warm_up() -> None:
    """What an episode would do on first use, done once at import: a warm host
    (simulate/agent_host.py) imports this module once and forks each episode from it, so what
    the first use builds is built once for all of them. One chat completion with tools and a
    tool message, made the way an episode makes them against a canned reply on a loopback
    socket: the openai client's imports, the caches of its request transform and the reply
    types it builds on first use (about 90 ms of CPU an episode); the verdict's HTTP client
    (httpcore's imports, about 40 ms); and the host's sandbox zygote, on which each episode
    runs its tests instead of starting its own (about 45 ms)."""
    warm_zygote()
    asyncio.run(_one_completion())


async def _one_completion() -> None:
    body = json.dumps(CANNED_REPLY).encode()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(verify=TLS)) as client:
        turns = ChatTurns(client, session_id="warm-up", user="warm-up")
        window = turns.open(TOOLS, "warm-up", "warm-up")
        sampling = Sampling(max_tokens=1, temperature=1.0, top_p=1.0, seed=0)
        turn = await turns.reply(window, sampling)
        turns.add_results(window, [(call, "warm-up") for call in turn.calls])
        await turns.reply(window, sampling)
    async with httpx.AsyncClient(verify=TLS):
        pass


# a chat completion as the endpoint answers one: a tool call, usage, the version's fingerprint
CANNED_REPLY = {
    "id": "chatcmpl-warm-up", "object": "chat.completion", "created": 0, "model": "flywheel",
    "system_fingerprint": "fw-v0-warm-up", "usage": {
        "prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
        "role": "assistant", "content": None, "tool_calls": [{
            "id": "call_warm_up", "type": "function", "function": {
                "name": "run_tests", "arguments": "{}"}}]}}]}


warm_up()


async def run_episode(environ: Mapping[str, str]) -> None:
    """One episode under the agent contract, ending with the verdict it sends."""
    task = Task.model_validate_json(Path(environ["FLYWHEEL_TASK"]).read_text())
    sampling = RolloutSampling.model_validate_json(environ["FLYWHEEL_SAMPLING"])
    session_id = environ["FLYWHEEL_SESSION_ID"]
    env = TaskEnvironment(task, Path(environ["FLYWHEEL_WORKSPACE"]), SandboxCache())
    async with openai.AsyncOpenAI(base_url=environ["OPENAI_BASE_URL"],
                                  api_key=environ["OPENAI_API_KEY"], max_retries=0,
                                  timeout=600,
                                  http_client=openai.DefaultAsyncHttpxClient(verify=TLS)
                                  ) as client:
        turns = ChatTurns(client, session_id=session_id, user=session_id)
        trajectory = await Harness(turns, HarnessConfig.of(sampling)).run(
            env, task_id=task.task_id, seed=int(environ["FLYWHEEL_SEED"]))
    result = await asyncio.to_thread(env.test_result)
    kind, value = verdict((result.tests_passed or 0) / max(1, result.tests_total or 0),
                          trajectory.flags)
    body, headers = session_verdict(session_id, kind, value, source="builtin-agent",
                                    secret=environ["FLYWHEEL_FEEDBACK_SECRET"])
    async with httpx.AsyncClient(timeout=60, verify=TLS) as http:
        reply = await http.post(environ["FLYWHEEL_FEEDBACK_URL"], content=body,
                                headers=headers)
        reply.raise_for_status()


def main() -> int:
    asyncio.run(run_episode(os.environ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
