"""A product's own coding agent, on the OpenAI Agents SDK, bootstrapped by Flywheel.

    flywheel bootstrap --agent examples/agents/coding_agent.py:main     # forked per episode
    flywheel bootstrap --agent "python examples/agents/coding_agent.py"  # a process per episode

This file knows nothing of Flywheel's code: it is an agent as a product would write it (its
own tools, instructions and loop, the SDK's), plus the few lines the agent contract asks for
(docs/bootstrap.md): it reads its task, workspace and sampling from the environment the rollout
worker gives it, talks to the OpenAI endpoint in OPENAI_BASE_URL with the key in OPENAI_API_KEY
(the SDK's client reads both), and at the end reports its verdict on its session, signed, to
FLYWHEEL_FEEDBACK_URL. Flywheel logs every model call the SDK makes, trains on those tokens,
and scores the workspace with the task's tests.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

# The default tiny model was mid-trained on Flywheel's built-in agent, so these words and tool
# names are close to its; a product's agent brings its own (and mid-trains on them first).
INSTRUCTIONS = "Fix solution.py, run the tests, finish."
TEST_TIMEOUT_S = 20
# one TLS context for every client (forked per episode from a warm host, each episode reuses
# it): building one loads the CA bundle, about 17 ms of CPU
TLS = ssl.create_default_context()

RUNNER = """
import json, sys
code, tests, entry = open(sys.argv[1]).read(), open(sys.argv[2]).read(), sys.argv[3]
namespace = {}
exec(code, namespace)
exec(tests, namespace)
names = [n for n in namespace if n.startswith("test_")] or ["check"]
passed = 0
for name in names:
    try:
        namespace[name]() if name != "check" else namespace[name](namespace[entry])
        passed += 1
    except Exception as exc:
        print(f"{name}: {type(exc).__name__}: {exc}"[:200])
print(json.dumps({"passed": passed, "total": len(names)}))
"""


class Episode:
    """What the rollout worker gave this episode (read when it starts, not at import: a warm
    host imports this file once and forks it per episode)."""

    def __init__(self) -> None:
        self.workspace = Path(os.environ["FLYWHEEL_WORKSPACE"]).resolve()
        self.task = json.loads(Path(os.environ["FLYWHEEL_TASK"]).read_text())
        self.sampling = json.loads(os.environ["FLYWHEEL_SAMPLING"])

    def inside(self, path: str) -> Path | None:
        target = (self.workspace / path).resolve()
        return target if target.is_relative_to(self.workspace) else None

    def test_run(self) -> tuple[int, int, str]:
        """The task's tests on the workspace's solution.py, in a child process: (passed,
        total, what failed)."""
        with tempfile.TemporaryDirectory() as tmp:
            tests = Path(tmp) / "tests.py"
            tests.write_text(self.task["tests"])
            try:
                out = subprocess.run(
                    [sys.executable, "-c", RUNNER, str(self.workspace / "solution.py"),
                     str(tests), self.task["entry_point"]], capture_output=True, text=True,
                    cwd=self.workspace, timeout=TEST_TIMEOUT_S).stdout.strip().splitlines()
            except subprocess.TimeoutExpired:
                return 0, 1, "the tests timed out"
        try:
            counts = json.loads(out[-1])
        except (IndexError, json.JSONDecodeError):
            return 0, 1, "\n".join(out[-3:]) or "the solution does not run"
        return counts["passed"], counts["total"], "\n".join(out[:-1][:2])

    async def solve(self) -> None:
        client = AsyncOpenAI(max_retries=0, timeout=600,  # OPENAI_BASE_URL, OPENAI_API_KEY
                             http_client=DefaultAsyncHttpxClient(verify=TLS))
        agent = Agent(
            name="coder", instructions=INSTRUCTIONS,
            model=OpenAIChatCompletionsModel(model="flywheel", openai_client=client),
            model_settings=ModelSettings(temperature=self.sampling["temperature"],
                                         max_tokens=self.sampling["max_tokens"]),
            tools=TOOLS, tool_use_behavior={"stop_at_tool_names": ["finish"]})
        try:
            await Runner.run(agent, (self.workspace / "solution.py").read_text(),
                             max_turns=self.sampling["max_turns"],
                             run_config=RunConfig(tracing_disabled=True))
        except MaxTurnsExceeded:
            pass  # out of turns: judged on the workspace as it stands

    def report_verdict(self) -> None:
        """The session's verdict, by this agent's own judge (the tests), signed as a
        webhook."""
        passed, total, _ = self.test_run()
        session = os.environ["FLYWHEEL_SESSION_ID"]
        event: dict[str, object] = {"event_id": f"verdict-{session}", "session_id": session,
                                    "source": "coding-agent-example"}
        if passed == total:
            event["kind"] = "accept"
        elif passed:
            event |= {"kind": "edit_kept", "value": round(passed / total, 4)}
        else:
            event["kind"] = "reject"
        body = json.dumps(event).encode()
        stamp = int(time.time())
        mac = hmac.new(os.environ["FLYWHEEL_FEEDBACK_SECRET"].encode(),
                       f"{stamp}.".encode() + body, hashlib.sha256).hexdigest()
        httpx.post(os.environ["FLYWHEEL_FEEDBACK_URL"], content=body, timeout=60, verify=TLS,
                   headers={"content-type": "application/json",
                            "Flywheel-Signature": f"t={stamp},v1={mac}"}).raise_for_status()



# The tools act on the episode this process runs (one per process: a warm host forks one
# process per episode), set by `main`; defined once, at import, so that a warm host builds
# their schemas once for every episode.
CURRENT: list[Episode] = []


@function_tool
def read_file(path: str) -> str:
    """Read a file."""
    target = CURRENT[0].inside(path)
    if target is None or not target.is_file():
        return f"error: no such file {path}"
    return target.read_text(errors="replace")[:2000]


@function_tool
def write_file(path: str, content: str) -> str:
    """Write a whole file."""
    target = CURRENT[0].inside(path)
    if target is None:
        return f"error: {path} is outside the workspace"
    target.write_text(content)
    return f"wrote {len(content)} characters to {path}"


@function_tool
def apply_edit(path: str, old: str, new: str) -> str:
    """Replace old with new."""
    target = CURRENT[0].inside(path)
    if target is None or not target.is_file():
        return f"error: no such file {path}"
    text = target.read_text()
    if not old or text.count(old) != 1:
        return f"error: old text not found once in {path}; nothing changed"
    target.write_text(text.replace(old, new))
    return f"edited {path}"


@function_tool
def run_tests() -> str:
    """Run the tests."""
    passed, total, failures = CURRENT[0].test_run()
    status = "passed" if passed == total else "failed"
    return f"{status}: {passed}/{total} tests passed\n{failures}".strip()


@function_tool
def finish() -> str:
    """End the task."""
    return "finished"


TOOLS = [read_file, write_file, apply_edit, run_tests, finish]


def warm_up() -> None:
    """What the OpenAI client and the verdict's HTTP client import and build on first use,
    done at import (once, in a warm host; httpx's transport alone imports for about 40 ms of
    CPU, which each forked episode would pay again)."""
    set_tracing_disabled(True)  # nothing leaves the machine
    httpx.Client(verify=TLS).close()

    async def open_and_close() -> None:
        async with AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="-",
                               http_client=DefaultAsyncHttpxClient(verify=TLS)) as client:
            assert client.chat.completions is not None

    asyncio.run(open_and_close())


warm_up()


def main() -> int:
    """One episode: solve, then report the verdict."""
    CURRENT[:] = [Episode()]
    asyncio.run(CURRENT[0].solve())
    CURRENT[0].report_verdict()
    return 0


if __name__ == "__main__":
    sys.exit(main())
