"""Simulated developers: an editor's coding agent on Flywheel's public API, and its verdicts.

Each developer takes a task of the product split (`simulate.tasks`), runs the same multi-turn
harness the bootstrap trains (`simulate.harness`) against the OpenAI-compatible endpoint with
the official `openai` client and function calling (`ChatTurns`: one chat completion per model
turn with `tools=`, the results sent back as `tool` messages, all turns of a session under
one `session_id`), and executes the tool calls in a sandboxed workspace on its own side, as
an editor's agent does. At the end it runs the task's hidden tests and judges the whole
session: `accept` when they all pass, `edit_kept` with the share that passes when some do,
`reject` otherwise (and when the anti-cheat checks of `simulate.rewards` flag the session).
The verdict is flipped with probability `noise` (people misjudge), sent after a random delay
(people react late, while they go on to their next task), and signed (`ingest.signing`) to
`POST /v1/feedback`, keyed by the session.

The live acceptance rate the demo plots is the share of sessions whose tests all pass, before
noise, per served model version (a session counts for a version when every turn of it was
served by that version).

    population = DeveloperPopulation(base_url, tasks, secret=secret)
    await population.run(until=lambda: done.is_set())
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from ingest.signing import SIGNATURE_HEADER, sign
from simulate.harness import (
    ContextFull,
    Harness,
    HarnessConfig,
    ModelTurn,
    Sampling,
    Trajectory,
)
from simulate.rollouts import SandboxCache, TaskEnvironment
from simulate.tasks import Task
from simulate.tools import ToolCall, render_call

MAX_FAILURES_KEPT = 5  # failed sessions whose errors the stats keep, for the report


def version_of(fingerprint: str) -> int:
    """The version number in a `system_fingerprint` ("fw-v3-<sha12>" -> 3)."""
    return int(fingerprint.split("-")[1].lstrip("v"))


@dataclass
class ChatWindow:
    """One context window as chat messages, with what the server said about each turn."""

    tools: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    tokens: int = 0  # prompt + completion tokens of the last reply
    generation_ids: list[str] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class ChatTurns:
    """`ModelTurns` over `POST /v1/chat/completions` with function calling, through the
    official client: the session's turns share `session_id`, so the server logs them as one
    session and feedback can name the whole of it."""

    def __init__(self, client: openai.AsyncOpenAI, *, session_id: str, user: str) -> None:
        self.client = client
        self.session_id = session_id
        self.user = user
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    def open(self, tools: list[dict[str, Any]], system: str, user: str,
             *extra_user: str) -> ChatWindow:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        messages += [{"role": "user", "content": text} for text in extra_user]
        return ChatWindow(tools, messages)

    def add(self, window: ChatWindow, content: str) -> None:
        window.messages.append({"role": "user", "content": content})

    def add_results(self, window: ChatWindow, results: list[tuple[ToolCall, str]]) -> None:
        window.messages += [{"role": "tool", "tool_call_id": call.id, "content": observation}
                            for call, observation in results]

    def length(self, window: ChatWindow) -> int:
        return window.tokens

    async def reply(self, window: ChatWindow, sampling: Sampling) -> ModelTurn:
        try:
            reply = await self.client.chat.completions.create(
                model="flywheel", messages=window.messages,  # type: ignore[arg-type]
                tools=window.tools, max_tokens=sampling.max_tokens,  # type: ignore[arg-type]
                temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
                user=self.user, extra_body={"session_id": self.session_id})
        except openai.BadRequestError as exc:
            if exc.code == "context_length_exceeded":  # the episode ends by its context
                raise ContextFull(str(exc)) from exc
            raise
        message = reply.choices[0].message
        calls = [ToolCall(c.function.name, json.loads(c.function.arguments), c.id)
                 for c in message.tool_calls or [] if c.type == "function"]
        said: dict[str, Any] = {"role": "assistant", "content": message.content}
        if calls:
            said["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]
        window.messages.append(said)
        window.tokens = reply.usage.total_tokens if reply.usage else window.tokens
        window.generation_ids.append(reply.id)
        self._version = version_of(str(reply.system_fingerprint))
        window.versions.append(self._version)
        text = (message.content or "") + "".join(render_call(c) for c in calls)
        return ModelTurn(text, calls)


@dataclass(frozen=True)
class SessionOutcome:
    """One developer session: what happened and what was reported."""

    task_id: str
    session_id: str
    versions: tuple[int, ...]  # per model turn
    passed: bool  # every hidden test passes and nothing was flagged: the true verdict
    tests_fraction: float
    flags: tuple[str, ...]
    kind: str  # the feedback sent (after noise)
    value: float | None
    finished_at: float
    delay_s: float = 0.0  # the verdict is sent this long after the session ends

    @property
    def version(self) -> int | None:
        """The version that served the whole session; None when a release swapped mid-way."""
        return self.versions[0] if len(set(self.versions)) == 1 else None


def verdict(passed_fraction: float, flags: Sequence[str]) -> tuple[str, float | None]:
    """(feedback kind, value) of a developer who ran the hidden tests."""
    if flags or passed_fraction <= 0.0:
        return "reject", None
    if passed_fraction >= 1.0:
        return "accept", None
    return "edit_kept", round(passed_fraction, 4)


def session_verdict(session_id: str, kind: str, value: float | None, *, source: str,
                    secret: str | None) -> tuple[bytes, dict[str, str]]:
    """A verdict on a whole session as `POST /v1/feedback` takes it: the body, and the headers
    (signed with `secret` where there is one)."""
    event: dict[str, Any] = {"event_id": f"verdict-{session_id}", "session_id": session_id,
                             "kind": kind, "source": source}
    if value is not None:
        event["value"] = value
    body = json.dumps(event).encode()
    headers = {"content-type": "application/json"}
    if secret is not None:
        headers[SIGNATURE_HEADER] = sign(secret, None, body)
    return body, headers


def with_noise(kind: str, value: float | None, flip: bool) -> tuple[str, float | None]:
    """A misjudgment: accept <-> reject, a partial edit kept whole or thrown away."""
    if not flip:
        return kind, value
    if kind == "edit_kept":
        return ("accept" if (value or 0.0) < 0.5 else "reject"), None
    return ("reject" if kind == "accept" else "accept"), None


@dataclass
class VersionStats:
    sessions: int = 0
    passed: int = 0

    @property
    def acceptance(self) -> float:
        return self.passed / self.sessions if self.sessions else 0.0


@dataclass
class PopulationStats:
    by_version: dict[int, VersionStats] = field(
        default_factory=lambda: defaultdict(VersionStats))
    sessions: int = 0
    spanning_swap: int = 0  # sessions served by two versions: counted for neither
    turns: int = 0
    cheating_flagged: int = 0
    failed_requests: int = 0
    failures: list[str] = field(default_factory=list)  # the first few, with their errors
    feedback_sent: int = 0
    feedback_failed: int = 0

    def record(self, outcome: SessionOutcome) -> None:
        self.sessions += 1
        self.turns += len(outcome.versions)
        self.cheating_flagged += bool(outcome.flags)
        if outcome.version is None:
            self.spanning_swap += 1
            return
        stats = self.by_version[outcome.version]
        stats.sessions += 1
        stats.passed += outcome.passed


@dataclass(frozen=True)
class DeveloperSettings:
    """How the simulated developers behave (the harness is the bootstrap's)."""

    concurrency: int = 8
    noise: float = 0.05  # probability of a misjudged verdict
    max_delay_s: float = 1.0  # feedback comes 0..max_delay_s after the session ends
    harness: HarnessConfig = HarnessConfig(max_turns=3, max_tokens=64)
    seed: int = 0


class DeveloperPopulation:
    """`concurrency` developers at a time on the product tasks, over one HTTP client pool."""

    def __init__(self, base_url: str, tasks: Sequence[Task], *, secret: str | None,
                 settings: DeveloperSettings | None = None,
                 workdir: Path | None = None) -> None:
        if not tasks:
            raise ValueError("simulated developers need at least one task")
        self.base_url, self.tasks, self.secret = base_url, list(tasks), secret
        self.settings = settings or DeveloperSettings()
        self.workdir = workdir
        self.rng = random.Random(self.settings.seed)
        self.stats = PopulationStats()
        self.outcomes: list[SessionOutcome] = []
        self.cache = SandboxCache()

    async def run(self, *, until: Callable[[], bool],
                  on_session: Callable[[SessionOutcome], None] | None = None) -> PopulationStats:
        """Keep `concurrency` sessions going until `until()` holds; every started session
        finishes and sends its feedback before this returns. `on_session` hears of each
        session as it ends, its verdict still to come."""
        limits = httpx.Limits(max_connections=2 * self.settings.concurrency)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=300,
                                     limits=limits) as http, openai.AsyncOpenAI(
                base_url=f"{self.base_url}/v1", api_key="developer", timeout=300,
                max_retries=0) as client:
            with tempfile.TemporaryDirectory(dir=self.workdir, prefix="developers-") as tmp:
                verdicts: set[asyncio.Task[None]] = set()

                async def developer(index: int) -> None:
                    number = index
                    while not until():
                        outcome = await self.session(client, http, Path(tmp) / f"{number}",
                                                     number)
                        number += self.settings.concurrency
                        if outcome is None:
                            continue
                        # the verdict comes late, and the developer does not wait for it
                        verdicts.add(task := asyncio.create_task(self.judge(http, outcome)))
                        task.add_done_callback(verdicts.discard)
                        if on_session is not None:
                            on_session(outcome)

                await asyncio.gather(*(developer(i) for i in range(self.settings.concurrency)))
                await asyncio.gather(*list(verdicts))
        return self.stats

    async def session(self, client: openai.AsyncOpenAI, http: httpx.AsyncClient, root: Path,
                      number: int) -> SessionOutcome | None:
        """One task, start to its judged outcome (`judge` reports it); None when a request
        failed (nothing is reported)."""
        task = self.rng.choice(self.tasks)
        flip = self.rng.random() < self.settings.noise
        session_id = f"dev-{uuid.uuid4().hex}"
        turns = ChatTurns(client, session_id=session_id, user=f"developer-{number % 64}")
        env = TaskEnvironment(task, root, self.cache)
        try:
            trajectory: Trajectory[Any] = await Harness(turns, self.settings.harness).run(
                env, task_id=task.task_id, seed=self.settings.seed * 100_003 + number)
        except (openai.APIError, httpx.HTTPError) as exc:
            self.stats.failed_requests += 1
            if len(self.stats.failures) < MAX_FAILURES_KEPT:
                self.stats.failures.append(f"{session_id}: {type(exc).__name__}: {exc}")
            return None
        result = await asyncio.to_thread(env.test_result)
        fraction = (result.tests_passed or 0) / max(1, result.tests_total or 0)
        passed = result.status == "passed" and not trajectory.flags
        kind, value = with_noise(*verdict(fraction, trajectory.flags), flip)
        versions = tuple(v for window in trajectory.segments for v in window.versions)
        outcome = SessionOutcome(task.task_id, session_id, versions, passed, fraction,
                                 tuple(trajectory.flags), kind, value, time.time(),
                                 delay_s=self.rng.uniform(0.0, self.settings.max_delay_s))
        self.stats.record(outcome)
        self.outcomes.append(outcome)
        return outcome

    async def judge(self, http: httpx.AsyncClient, outcome: SessionOutcome) -> None:
        """The developer's verdict on a finished session, `outcome.delay_s` later."""
        await asyncio.sleep(outcome.delay_s)
        await self.send_feedback(http, outcome)

    async def send_feedback(self, http: httpx.AsyncClient, outcome: SessionOutcome) -> None:
        body, headers = session_verdict(outcome.session_id, outcome.kind, outcome.value,
                                        source="simulated-developer", secret=self.secret)
        try:
            (await http.post("/v1/feedback", content=body, headers=headers)).raise_for_status()
        except httpx.HTTPError:
            self.stats.feedback_failed += 1
            return
        self.stats.feedback_sent += 1
