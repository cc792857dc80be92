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
import os
import ssl
import sys
from collections.abc import Mapping
from pathlib import Path

import httpx
import openai

from ingest.rollout_events import RolloutSampling
from simulate.developers import ChatTurns, session_verdict, verdict
from simulate.harness import Harness, HarnessConfig
from simulate.rollouts import SandboxCache, TaskEnvironment
from simulate.tasks import Task
from simulate.zygote import warm_zygote

# one TLS context for every client this process opens (each episode's, forked from a warm
# host): building one loads the CA bundle, about 17 ms of CPU, and an episode opens two
TLS = ssl.create_default_context()


def warm_up() -> None:
    """What an episode would start on first use, done once at import: a warm host
    (simulate/agent_host.py) imports this module once, and each episode forked from it then
    opens and closes its client in 6 ms of CPU instead of 120 (what the openai client imports
    and builds on first use), and runs its tests on the host's sandbox zygote instead of
    starting its own (about 45 ms)."""
    warm_zygote()

    async def open_and_close() -> None:
        async with openai.AsyncOpenAI(
                base_url="http://127.0.0.1:9/v1", api_key="-",
                http_client=openai.DefaultAsyncHttpxClient(verify=TLS)) as client:
            assert client.chat.completions is not None

    asyncio.run(open_and_close())


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
