"""Agent programs make the bootstrap's groups over the OpenAI API (app/rollouts/): real agent
processes (`scripted_agent.py`, the built-in harness's `python -m simulate.builtin_agent`) on
a real endpoint serving the tiny model, every generation logged to its episode."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.rollouts.agent_groups import AgentFailure, AgentGroups
from app.rollouts.endpoint import RolloutEndpoint
from ingest.config import KafkaConfig
from ingest.log import EventProducer
from ingest.rollout_events import RolloutJob, RolloutSampling
from serving.backends import build_engine
from serving.config import EngineSettings
from simulate.agents import BUILTIN_AGENT, AgentProgram
from simulate.rollouts import SandboxCache, unpack_segments
from tests.conftest import SKILL_TASKS

SCRIPT = str(Path(__file__).with_name("scripted_agent.py"))


@pytest.fixture
def endpoint(kafka: KafkaConfig, model_dir: Path, tmp_path: Path) -> Iterator[RolloutEndpoint]:
    engine = build_engine(EngineSettings(), model_dir)
    producer = EventProducer(kafka, client_id="rollout-endpoint-test")
    try:
        with RolloutEndpoint.serve(engine, producer, kafka, tmp_path) as served:
            yield served
    finally:
        producer.close()
        engine.close()


def job(group_size: int = 2, *, temperature: float = 1.0) -> RolloutJob:
    return RolloutJob(job_id="job-1", run_id="run", step=0, min_version=0,
                      group_size=group_size, seed=7, task=SKILL_TASKS[0],
                      sampling=RolloutSampling(temperature=temperature, max_tokens=16,
                                               max_turns=2, context_budget=1024))


def scripted(behavior: str, reports: Path, **walls: object) -> AgentProgram:
    reports.mkdir(exist_ok=True)
    return AgentProgram(command=["{python}", SCRIPT, behavior, str(reports)], **walls)


def groups(program: AgentProgram, endpoint: RolloutEndpoint, tmp_path: Path) -> AgentGroups:
    return AgentGroups(program, endpoint, SandboxCache(), tmp_path)


def test_an_episode_is_built_from_the_logged_generations_and_scored_on_the_workspace(
        endpoint: RolloutEndpoint, tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    group = asyncio.run(groups(scripted("well", reports), endpoint, tmp_path).group(job()))
    assert group.dropped == {} and len(group.trajectories) == 2
    for trajectory in group.trajectories:
        # the agent wrote the canonical solution: the task's tests pass on its workspace
        assert trajectory.reward == 1.0 and trajectory.flags == [] and trajectory.turns == 2
    # each episode's trained tokens carry exactly the logprobs its agent was served, in order
    served = sorted([round(p, 4) for turn in json.loads(path.read_text())
                     for p in turn["logprobs"]] for path in reports.glob("rollout-*.json"))
    trained = sorted([round(p, 4) for w in unpack_segments(t)
                      for p, m in zip(w.logprobs, w.loss_mask, strict=True) if m]
                     for t in group.trajectories)
    assert served == trained

def test_a_client_that_rewrites_its_history_trains_on_the_tokens_the_model_sampled(
        endpoint: RolloutEndpoint, tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    group = asyncio.run(groups(scripted("rewrite", reports), endpoint, tmp_path).group(job(1)))
    [trajectory] = group.trajectories
    [seen] = [json.loads(p.read_text()) for p in reports.glob("rollout-*.json")]
    windows = unpack_segments(trajectory)
    # the second prompt does not continue the first reply: a window of its own, and each
    # window's trained tokens are the completion the model sampled in it, nothing the client
    # wrote in its place
    assert len(windows) == 2
    for window, turn in zip(windows, seen, strict=True):
        assert sum(window.loss_mask) == turn["completion_tokens"]
        trained = [p for p, m in zip(window.logprobs, window.loss_mask, strict=True) if m]
        assert trained == pytest.approx(turn["logprobs"], abs=1e-4)


def test_a_sigkilled_agent_loses_nothing_and_trains_nothing_twice(
        endpoint: RolloutEndpoint, tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    group = asyncio.run(groups(scripted("sigkill", reports), endpoint, tmp_path).group(job()))
    # the killed episode (one generation made) is dropped and made again; the group holds
    # two whole episodes, two generations each, and nothing of the killed one
    assert group.dropped == {"crashed": 1}
    assert [t.turns for t in group.trajectories] == [2, 2]
    assert len(list(reports.glob("rollout-*.json"))) == 2


def test_a_forged_verdict_is_refused_and_its_episode_made_again(
        endpoint: RolloutEndpoint, tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    group = asyncio.run(groups(scripted("forge", reports), endpoint, tmp_path).group(job()))
    assert (reports / "forged").read_text() == "403"
    assert group.dropped == {"forged_verdict": 1} and len(group.trajectories) == 2


@pytest.mark.parametrize(("behavior", "reason", "walls"), [
    ("crash", "crashed", {}),
    ("hang", "deadline", {"deadline_s": 20.0}),
    ("silent", "no_verdict", {}),
    ("flood", "flood", {"max_requests": 3}),
    ("temperature", "temperature", {}),
])
def test_a_misbehaving_episode_is_dropped_by_reason(
        endpoint: RolloutEndpoint, tmp_path: Path, behavior: str, reason: str,
        walls: dict[str, object]) -> None:
    made = groups(scripted(behavior, tmp_path / "reports", **walls), endpoint, tmp_path)
    group = asyncio.run(made.group(job(1)))
    assert group.dropped == {reason: 1} and group.trajectories[0].reward == 1.0
    # an agent that never behaves fails the job, saying why
    always = groups(scripted(behavior, tmp_path / "again", attempts=1, **walls), endpoint,
                    tmp_path)
    with pytest.raises(AgentFailure, match=reason):
        asyncio.run(always.group(job(1)))


def test_the_builtin_harness_runs_as_an_agent_program(endpoint: RolloutEndpoint,
                                                      tmp_path: Path) -> None:
    program = AgentProgram(command=BUILTIN_AGENT)
    assert program.argv(sys.executable)[0] == sys.executable
    group = asyncio.run(groups(program, endpoint, tmp_path).group(job()))
    assert group.dropped == {} and len(group.trajectories) == 2
    for trajectory in group.trajectories:
        assert 1 <= trajectory.turns <= 2 and sum(trajectory.loss_mask.unpack()) > 0


def test_an_agent_on_the_openai_agents_sdk_makes_a_group(endpoint: RolloutEndpoint,
                                                         tmp_path: Path) -> None:
    """The example in examples/agents/: the SDK's own loop and tools, its every model call
    logged and trained, its workspace scored by the task's tests."""
    example = Path(__file__).resolve().parents[3] / "examples" / "agents" / "coding_agent.py"
    program = AgentProgram(command=["{python}", str(example)])
    group = asyncio.run(groups(program, endpoint, tmp_path).group(job()))
    assert group.dropped == {} and len(group.trajectories) == 2
    for trajectory in group.trajectories:
        assert trajectory.turns >= 1 and sum(trajectory.loss_mask.unpack()) > 0
        assert 0.0 <= trajectory.reward <= 1.0
