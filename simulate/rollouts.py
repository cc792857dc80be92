"""Group rollouts: G episodes of one task from the same Engine, scored by the task's tests.

`TaskEnvironment` adapts `simulate.tools.ToolWorkspace` to the harness: one private workspace
per episode, `run_tests` and the final score go through the sandbox, and sandbox results are
cached by (task, file contents) since the tests are deterministic and a group often writes the
same code many times. A group is returned as the `RolloutGroup` wire type (`ingest.events`).

    group = await rollout_group(harness, task, group_size=8, workdir=tmp, cache=SandboxCache())
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import tempfile
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ingest.events import GenerationLogged, PackedArray
from ingest.rollout_events import RolloutGroup, RolloutTrajectory
from simulate.harness import Harness, Segment, Trajectory
from simulate.rewards import (
    JudgeError,
    Reward,
    RewardConfig,
    compute_reward,
    file_hashes,
    test_files,
)
from simulate.sandbox import SandboxJob, SandboxResult, run_sandboxed
from simulate.sandbox_service import SandboxRunner
from simulate.tasks import Task
from simulate.tools import SOLUTION_FILE, TOOL_SETS, ToolCall, ToolWorkspace

log = logging.getLogger(__name__)

SYSTEM_PROMPT = "Fix solution.py, run the tests, finish."


class SandboxCache:
    """Thread-safe memo of sandbox results keyed by the job's code, tests and files. `runner`
    runs a miss: the local sandbox by default, or the sandbox fleet
    (`simulate.sandbox_service.sandbox_runner`)."""

    def __init__(self, runner: SandboxRunner = run_sandboxed) -> None:
        self.runner = runner
        self._results: dict[str, SandboxResult] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def run(self, job: SandboxJob) -> SandboxResult:
        key = hashlib.sha256(job.model_dump_json(exclude={"limits", "policy"}).encode()).hexdigest()
        with self._lock:
            if key in self._results:
                self.hits += 1
                return self._results[key]
        result = self.runner(job)
        with self._lock:
            self.misses += 1
            self._results[key] = result
        return result

    def count(self, *, hits: int, misses: int) -> None:
        """Add the counts of a cache in another process (a rollout child's)."""
        with self._lock:
            self.hits += hits
            self.misses += misses


class TaskEnvironment:
    """One episode on one task: a `ToolWorkspace` whose tests run through a `SandboxCache`,
    scored by `simulate.rewards.compute_reward`: the tests' verdict, zeroed with the reason
    when the episode cheated (edited test files, special-cased the expected outputs, looked
    at the harness, tried to leave the sandbox)."""

    def __init__(self, task: Task, root: Path, cache: SandboxCache,
                 rewards: RewardConfig | None = None) -> None:
        self.task = task
        # its sandbox jobs (shell commands) go where the cache sends its misses
        self.workspace = ToolWorkspace.create(root, task, runner=cache.runner)
        self.cache = cache
        self.rewards = rewards or RewardConfig()
        self._tests_before = file_hashes(test_files(task.files))

    def system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def task_prompt(self) -> str:
        return self.task.starting_file

    def max_turns(self) -> int | None:
        return self.task.max_turns

    def tools(self) -> list[dict[str, Any]]:
        return TOOL_SETS[self.task.tools]

    def step(self, calls: list[ToolCall]) -> tuple[list[str], bool]:
        observations = []
        for call in calls:
            if call.name == "run_tests" and not call.arguments and not self.workspace.finished:
                observations.append(_test_report(self.cache.run(self.workspace.sandbox_job())))
                continue
            result = self.workspace.run(call)
            observations.append(result.observation)
            if result.done:
                return observations, True
        return observations, False

    def test_result(self) -> SandboxResult:
        return self.cache.run(self.workspace.sandbox_job())

    def reward(self) -> Reward:
        """The final workspace's reward (1.0 = solved, by default 0.5 x the share of tests
        passed otherwise; 0 with flags when it cheated), blended with the judge's score when
        `rewards` names one. A judge that fails mid-run (its endpoint down, a reply with no
        score) leaves the episode scored by its tests alone, with a warning: a rollout fleet
        does not stop for it (the bootstrap checks the judge once before it starts)."""
        files = self.workspace.files()
        score = partial(compute_reward, prompt=self.task.starting_file,
                        code=files.get(SOLUTION_FILE, ""), tests=self.task.tests,
                        result=self.test_result(), test_files_before=self._tests_before,
                        test_files_after=file_hashes(test_files(files)))
        try:
            return score(config=self.rewards)
        except JudgeError as exc:
            log.warning("%s: %s; this episode is scored by its tests alone",
                        self.task.task_id, exc)
            return score(config=self.rewards.model_copy(update={"judge": None}))


def _test_report(result: SandboxResult) -> str:
    lines = [f"{result.status}: {result.tests_passed or 0}/{result.tests_total or 0} tests passed",
             *result.failures[:2]]
    return "\n".join(lines)[:400]


async def rollout_group(harness: Harness[Segment], task: Task, *, group_size: int,
                        cache: SandboxCache,
                        workdir: Path | None = None, seed: int | None = None,
                        policy_version: int | None = None,
                        rewards: RewardConfig | None = None) -> RolloutGroup:
    """Run `group_size` episodes of `task` concurrently on the harness's engine, scored by
    `rewards` (default: the tests alone)."""
    with tempfile.TemporaryDirectory(dir=workdir, prefix="rollout-") as tmp:
        envs = [TaskEnvironment(task, Path(tmp) / str(i), cache, rewards)
                for i in range(group_size)]
        trajectories = await asyncio.gather(*(
            harness.run(env, task_id=task.task_id, policy_version=policy_version,
                        seed=None if seed is None else seed * 1000 + i)
            for i, env in enumerate(envs)))
    version = trajectories[0].policy_version
    return to_event(task.task_id, trajectories, policy_version=version)


def solved(trajectory: RolloutTrajectory) -> bool:
    return trajectory.reward >= 1.0


def to_event(task_id: str, trajectories: list[Trajectory[Segment]], *,
             policy_version: int) -> RolloutGroup:
    return RolloutGroup(group_id=uuid.uuid4().hex, task_id=task_id, policy_version=policy_version,
                        trajectories=[pack_trajectory(t) for t in trajectories])


def pack_trajectory(traj: Trajectory[Segment]) -> RolloutTrajectory:
    segments = traj.segments
    routes = None
    if all(s.routes is not None for s in segments):
        # one row per token: each segment's routed rows, zero-padded to its length
        routes = PackedArray.pack(np.concatenate([_pad_rows(s.routes, len(s)) for s in segments
                                                  if s.routes is not None]), "int16")
    return RolloutTrajectory(
        token_ids=PackedArray.pack([t for s in segments for t in s.token_ids], "int32"),
        loss_mask=PackedArray.pack([m for s in segments for m in s.loss_mask], "uint8"),
        logprobs=PackedArray.pack([p for s in segments for p in s.logprobs], "float32"),
        segment_lengths=PackedArray.pack([len(s) for s in segments], "int32"),
        routed_experts=routes, reward=traj.reward, turns=traj.turns, finished=traj.finished,
        flags=traj.flags, ended_by=traj.ended_by)


def _pad_rows(routes: np.ndarray, rows: int) -> np.ndarray:
    """A segment's routes to one row per token: the tokens after its last engine call (a
    closing tag the harness added) have none, NO_ROUTE, so that a replay leaves them to the
    router."""
    from kernels.moe_replay import NO_ROUTE  # torch: only where an engine routed experts

    routes = np.asarray(routes, dtype=np.int16)[:rows]
    pad = np.full((rows - len(routes), *routes.shape[1:]), NO_ROUTE, dtype=np.int16)
    return np.concatenate([routes, pad])


def episode_shape(episodes: Sequence[RolloutTrajectory]) -> dict[str, float]:
    """How long the episodes ran: turns and summaries per episode, tokens per context window,
    and the share ended by a context with no room for another turn."""
    windows = [int(n) for t in episodes for n in t.segment_lengths.unpack()]
    return {"turns_per_episode": sum(t.turns for t in episodes) / len(episodes),
            "summaries_per_episode": (len(windows) - len(episodes)) / len(episodes),
            "tokens_per_window": sum(windows) / len(windows),
            "ended_by_context": sum(t.ended_by == "context" for t in episodes) / len(episodes)}


def mean_episode_shape(steps: Sequence[dict[str, float]]) -> dict[str, float]:
    """`episode_shape`'s figures over a run: the mean of its steps' (each trains as many
    episodes), rounded; NaN where no step reported them."""
    keys = ("turns_per_episode", "summaries_per_episode", "tokens_per_window",
            "ended_by_context")
    shaped = [step for step in steps if keys[0] in step]
    return {k: round(sum(step[k] for step in shaped) / len(shaped), 3) if shaped else math.nan
            for k in keys}


def unpack_segments(traj: RolloutTrajectory) -> list[Segment]:
    """The context windows of a packed trajectory, each with its tokens' routes where the
    trajectory carries them (`routed_experts`), for the learner to replay."""
    ids, mask = traj.token_ids.unpack(), traj.loss_mask.unpack()
    logprobs = traj.logprobs.unpack()
    routes = None if traj.routed_experts is None else traj.routed_experts.unpack()
    segments, start = [], 0
    for length in traj.segment_lengths.unpack().tolist():
        end = start + int(length)
        segments.append(Segment(token_ids=ids[start:end].tolist(),
                                loss_mask=mask[start:end].tolist(),
                                logprobs=logprobs[start:end].tolist(),
                                routes=None if routes is None else routes[start:end]))
        start = end
    return segments


def episode_segments(records: Sequence[GenerationLogged]) -> list[Segment]:
    """An episode's generations (in the order served) as training windows: a generation joins
    the window before it when its prompt starts with that window's tokens exactly (the agent
    sent back what the model sampled), and opens a window of its own otherwise (a client that
    re-rendered, summarized or rewrote its history): the sampled tokens are trained as they
    were sampled either way. A window's routes are its last generation's, which cover it."""
    segments: list[Segment] = []
    for record in records:
        prompt = record.prompt_token_ids.tolist()
        completion = record.completion_token_ids.tolist()
        last = segments[-1] if segments else None
        if last is None or prompt[:len(last)] != last.token_ids:
            last = Segment()
            segments.append(last)
        last.extend(prompt[len(last):])
        last.extend(completion, model=True, logprobs=record.logprobs.tolist())
        last.routes = None if record.routed_experts is None else record.routed_experts.unpack()
    return segments


def episode_trajectory(records: Sequence[GenerationLogged], *, task_id: str, reward: float,
                       flags: list[str]) -> RolloutTrajectory:
    """One agent episode, from its logged generations, as the learner takes rollouts."""
    segments = episode_segments(records)
    return pack_trajectory(Trajectory(
        task_id=task_id, segments=segments, policy_version=records[0].model_version,
        reward=reward, turns=len(records), ended_by="finished", flags=flags))


@dataclass(frozen=True)
class TaskOutcome:
    """One evaluation episode: whether every test passed, and the final solution file."""

    task_id: str
    passed: bool
    solution: str


async def run_once(harness: Harness[Segment], tasks: list[Task], *, cache: SandboxCache,
                   workdir: Path | None = None, seed: int = 0) -> list[TaskOutcome]:
    """One episode per task (greedy when the harness temperature is 0), scored on the final
    workspace."""
    with tempfile.TemporaryDirectory(dir=workdir, prefix="eval-") as tmp:
        envs = [TaskEnvironment(t, Path(tmp) / str(i), cache) for i, t in enumerate(tasks)]
        await asyncio.gather(*(harness.run(env, task_id=env.task.task_id, seed=seed + i)
                               for i, env in enumerate(envs)))
        return [TaskOutcome(env.task.task_id, env.test_result().status == "passed",
                            (env.workspace.root / SOLUTION_FILE).read_text()) for env in envs]


def pass_rate(outcomes: list[TaskOutcome]) -> float:
    """pass@1 of one episode per task: the fraction whose tests all passed."""
    return sum(o.passed for o in outcomes) / max(1, len(outcomes))
