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

# the tests' runner, in a fresh interpreter (-I -S: no site, nothing of the environment; and
# no import of its own: each one is paid again at every run)
RUNNER = """
import sys
code, tests, entry = open(sys.argv[1]).read(), sys.stdin.read(), sys.argv[2]
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
print("passed", passed, len(names))
"""


class Episode:
    """What the rollout worker gave this episode (read when it starts, not at import: a warm
    host imports this file once and forks it per episode)."""

    def __init__(self) -> None:
        self.workspace = Path(os.environ["FLYWHEEL_WORKSPACE"]).resolve()
        self.task = json.loads(Path(os.environ["FLYWHEEL_TASK"]).read_text())
        self.sampling = json.loads(os.environ["FLYWHEEL_SAMPLING"])
        self.tested: tuple[bytes, tuple[int, int, str]] | None = None  # code, its last run

    def inside(self, path: str) -> Path | None:
        target = (self.workspace / path).resolve()
        return target if target.is_relative_to(self.workspace) else None

    def test_run(self) -> tuple[int, int, str]:
        """The task's tests on the workspace's solution.py, in a child process: (passed,
        total, what failed). The verdict reuses the last run when the code is unchanged."""
        code = (self.workspace / "solution.py").read_bytes()
        if self.tested is not None and self.tested[0] == code:
            return self.tested[1]
        try:
            out = subprocess.run(
                [sys.executable, "-I", "-S", "-c", RUNNER, "solution.py",
                 self.task["entry_point"]], input=self.task["tests"], capture_output=True,
                text=True, cwd=self.workspace, timeout=TEST_TIMEOUT_S).stdout.splitlines()
        except subprocess.TimeoutExpired:
            return 0, 1, "the tests timed out"
        last = out[-1].split() if out else []
        if len(last) != 3 or last[0] != "passed":
            result = 0, 1, "\n".join(out[-3:]) or "the solution does not run"
        else:
            result = int(last[1]), int(last[2]), "\n".join(out[:-1][:2])
        self.tested = code, result
        return result

    async def solve(self) -> None:
        client = AsyncOpenAI(max_retries=0, timeout=600,  # OPENAI_BASE_URL, OPENAI_API_KEY
                             http_client=DefaultAsyncHttpxClient(verify=TLS))
        await run_coder(client, (self.workspace / "solution.py").read_text(), self.sampling)

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
        post_verdict(os.environ["FLYWHEEL_FEEDBACK_URL"], body,
                     {"Flywheel-Signature": f"t={stamp},v1={mac}"})


async def run_coder(client: AsyncOpenAI, prompt: str, sampling: dict) -> None:
    """The agent's loop (the SDK's) on `prompt`, until `finish` or out of turns."""
    agent = Agent(
        name="coder", instructions=INSTRUCTIONS,
        model=OpenAIChatCompletionsModel(model="flywheel", openai_client=client),
        model_settings=ModelSettings(temperature=sampling["temperature"],
                                     max_tokens=sampling["max_tokens"]),
        tools=TOOLS, tool_use_behavior={"stop_at_tool_names": ["finish"]})
    try:
        await Runner.run(agent, prompt, max_turns=sampling["max_turns"],
                         run_config=RunConfig(tracing_disabled=True))
    except MaxTurnsExceeded:
        pass  # out of turns: judged on the workspace as it stands


def post_verdict(url: str, body: bytes, headers: dict[str, str]) -> None:
    httpx.post(url, content=body, timeout=60, verify=TLS,
               headers={"content-type": "application/json", **headers}).raise_for_status()



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
    """What an episode builds on first use, built once at import: a warm host imports this
    file once and forks each episode from it, so what is built here is built for all of them.
    One run of the agent and one verdict against a canned reply on a loopback socket: the
    OpenAI client's and the SDK's lazy imports (anyio's backend, httpcore's), the pydantic
    models they complete on first validation and the caches of the client's request
    transform (with it, the machine's CPU per episode fell from about 300 to 220 ms under a
    profiler on a 2-core VM)."""
    set_tracing_disabled(True)  # nothing leaves the machine
    asyncio.run(_rehearse())


async def _rehearse() -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(CANNED_REPLY), CANNED_REPLY))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server, AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0,
                                   http_client=DefaultAsyncHttpxClient(verify=TLS)) as client:
        await run_coder(client, "warm-up", {"temperature": 1.0, "max_tokens": 1, "max_turns": 2})
        await asyncio.to_thread(post_verdict, f"{url}/v1/feedback", b"{}", {})


# a chat completion as the endpoint answers one: the agent calls `finish`, which ends its run
CANNED_REPLY = json.dumps({
    "id": "chatcmpl-warm-up", "object": "chat.completion", "created": 0, "model": "flywheel",
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
        "role": "assistant", "content": None, "tool_calls": [{
            "id": "call_warm_up", "type": "function",
            "function": {"name": "finish", "arguments": "{}"}}]}}]}).encode()


warm_up()


def main() -> int:
    """One episode: solve, then report the verdict."""
    CURRENT[:] = [Episode()]
    asyncio.run(CURRENT[0].solve())
    CURRENT[0].report_verdict()
    return 0


if __name__ == "__main__":
    sys.exit(main())
