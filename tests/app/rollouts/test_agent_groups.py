"""Agent programs make the bootstrap's groups over the OpenAI API (app/rollouts/): real agent
processes (`scripted_agent.py`, the built-in harness's `python -m simulate.builtin_agent`) on
a real endpoint serving the tiny model, every generation logged to its episode."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from app.cli.main import agent_program
from app.rollouts.agent_groups import AgentFailure, AgentGroups
from app.rollouts.endpoint import RolloutEndpoint
from app.settings import Settings
from ingest.config import KafkaConfig
from ingest.log import EventProducer
from ingest.rollout_events import RolloutJob, RolloutSampling
from serving.backends import build_engine
from simulate.agents import BUILTIN_AGENT, BUILTIN_ENTRY_POINT, AgentProgram
from simulate.rollouts import SandboxCache, unpack_segments
from tests.conftest import SKILL_TASKS

SCRIPT = str(Path(__file__).with_name("scripted_agent.py"))


@pytest.fixture
def endpoint(kafka: KafkaConfig, model_dir: Path, tmp_path: Path) -> Iterator[RolloutEndpoint]:
    engine = build_engine(Settings().engine, model_dir)
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


def scripted(behavior: str, reports: Path, *, warm: bool = False,
             **walls: object) -> AgentProgram:
    """The scripted agent as a command, or (`warm`) as an entry point the warm host forks."""
    reports.mkdir(exist_ok=True)
    if not warm:
        return AgentProgram(command=["{python}", SCRIPT, behavior, str(reports)], **walls)
    entry = reports / "entry.py"
    # it prints, at import and in each episode: nothing of it may reach the host's answers
    entry.write_text("from pathlib import Path\n"
                     "from tests.app.rollouts.scripted_agent import main\n\n"
                     "print('imported')\n\n\n"
                     "def run() -> int:\n    print('episode')\n"
                     f"    return main({behavior!r}, Path({str(reports)!r}))\n")
    return AgentProgram(entry_point=f"{entry}:run", **walls)


Groups = Callable[[AgentProgram], AgentGroups]


@pytest.fixture
def groups(endpoint: RolloutEndpoint, tmp_path: Path) -> Iterator[Groups]:
    """Makes `AgentGroups` of a program on the endpoint; their warm hosts stop at the end."""
    made: list[AgentGroups] = []

    def make(program: AgentProgram) -> AgentGroups:
        made.append(AgentGroups(program, endpoint, SandboxCache(), tmp_path))
        return made[-1]

    yield make
    for each in made:
        each.close()


def test_an_episode_is_built_from_the_logged_generations_and_scored_on_the_workspace(
        groups: Groups, tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    group = asyncio.run(groups(scripted("well", reports)).group(job()))
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
        groups: Groups, tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    group = asyncio.run(groups(scripted("rewrite", reports)).group(job(1)))
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


def test_only_an_open_episodes_key_reaches_the_model(endpoint: RolloutEndpoint) -> None:
    """The episodes' keys live in the endpoint's memory, as long as their episode."""
    episode = endpoint.open("rollout-keys", temperature=1.0, max_requests=8)

    def models(key: str) -> int:
        return httpx.get(f"{endpoint.base_url}/v1/models",
                         headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code

    assert models(episode.key) == 200
    assert models(episode.key[:-1] + ("A" if episode.key[-1] != "A" else "B")) == 401
    assert models("fwk-unknown.secret") == 401
    endpoint.close(episode)
    assert models(episode.key) == 401


@pytest.mark.parametrize("warm", [False, True], ids=["process", "warm-host"])
def test_a_sigkilled_agent_loses_nothing_and_trains_nothing_twice(
        groups: Groups, tmp_path: Path, warm: bool) -> None:
    reports = tmp_path / "reports"
    group = asyncio.run(groups(scripted("sigkill", reports, warm=warm)).group(job()))
    # the killed episode (one generation made) is dropped and made again; the group holds
    # two whole episodes, two generations each, and nothing of the killed one
    assert group.dropped == {"crashed": 1}
    assert [t.turns for t in group.trajectories] == [2, 2]
    assert len(list(reports.glob("rollout-*.json"))) == 2


def test_a_forged_verdict_is_refused_and_its_episode_made_again(
        groups: Groups, tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    group = asyncio.run(groups(scripted("forge", reports)).group(job()))
    assert (reports / "forged").read_text() == "403"
    assert group.dropped == {"forged_verdict": 1} and len(group.trajectories) == 2


# the hung episode runs out its deadline (twice a test); a well-behaved one takes 1-4 s here,
# under the other xdist workers' load as well
@pytest.mark.parametrize(("behavior", "reason", "walls", "warm"), [
    ("crash", "crashed", {}, False),
    ("crash", "crashed", {}, True),
    ("hang", "deadline", {"deadline_s": 10.0}, False),
    ("hang", "deadline", {"deadline_s": 10.0}, True),
    ("silent", "no_verdict", {}, False),
    ("flood", "flood", {"max_requests": 3}, False),
    ("temperature", "temperature", {}, False),
])
def test_a_misbehaving_episode_is_dropped_by_reason(
        groups: Groups, tmp_path: Path, behavior: str, reason: str,
        walls: dict[str, object], warm: bool) -> None:
    made = groups(scripted(behavior, tmp_path / "reports", warm=warm, **walls))
    group = asyncio.run(made.group(job(1)))
    assert group.dropped == {reason: 1} and group.trajectories[0].reward == 1.0
    # an agent that never behaves fails the job, saying why
    always = groups(scripted(behavior, tmp_path / "again", warm=warm, attempts=1, **walls))
    with pytest.raises(AgentFailure, match=reason):
        asyncio.run(always.group(job(1)))


@pytest.mark.parametrize("program", [AgentProgram(command=BUILTIN_AGENT),
                                     AgentProgram(entry_point=BUILTIN_ENTRY_POINT)],
                         ids=["process", "warm-host"])
def test_the_builtin_harness_runs_as_an_agent_program(groups: Groups,
                                                      tmp_path: Path,
                                                      program: AgentProgram) -> None:
    assert program.argv(sys.executable)[0] == sys.executable
    group = asyncio.run(groups(program).group(job()))
    assert group.dropped == {} and len(group.trajectories) == 2
    for trajectory in group.trajectories:
        assert 1 <= trajectory.turns <= 2 and sum(trajectory.loss_mask.unpack()) > 0


EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "agents" / "coding_agent.py"


@pytest.mark.parametrize("program", [AgentProgram(command=["{python}", str(EXAMPLE)]),
                                     AgentProgram(entry_point=f"{EXAMPLE}:main")],
                         ids=["process", "warm-host"])
def test_an_agent_on_the_openai_agents_sdk_makes_a_group(groups: Groups,
                                                         program: AgentProgram) -> None:
    """The example in examples/agents/: the SDK's own loop and tools, its every model call
    logged and trained, its workspace scored by the task's tests."""
    group = asyncio.run(groups(program).group(job()))
    assert group.dropped == {} and len(group.trajectories) == 2
    for trajectory in group.trajectories:
        assert trajectory.turns >= 1 and sum(trajectory.loss_mask.unpack()) > 0
        assert 0.0 <= trajectory.reward <= 1.0


def test_the_agent_flag_names_the_builtin_an_entry_point_or_a_command() -> None:
    assert agent_program("builtin") == AgentProgram(entry_point=BUILTIN_ENTRY_POINT)
    assert agent_program("pkg.agent:run") == AgentProgram(entry_point="pkg.agent:run")
    relative = EXAMPLE.relative_to(Path.cwd())
    assert agent_program(f"{relative}:main") == AgentProgram(entry_point=f"{EXAMPLE}:main")
    assert agent_program(f"python {relative} --fast") == AgentProgram(
        command=["python", str(EXAMPLE), "--fast"])
    assert agent_program(None) is None
