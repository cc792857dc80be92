"""The built-in harness run as an agent program over the OpenAI API makes the rows it makes in
the worker's process on token ids, for the same job and seeds: the in-process path the default
bootstrap keeps is a fast path of the agent path, not another environment."""

from __future__ import annotations

import asyncio
from pathlib import Path

from app.rollouts.agent_groups import AgentGroups
from app.rollouts.endpoint import RolloutEndpoint
from app.settings import Settings
from ingest.config import KafkaConfig
from ingest.log import EventProducer
from ingest.rollout_events import RolloutJob, RolloutSampling
from serving.backends import build_engine
from simulate.agents import BUILTIN_AGENT, AgentProgram
from simulate.harness import Harness, HarnessConfig
from simulate.rollouts import SandboxCache, rollout_group, unpack_segments
from simulate.tasks import JsonlTasksConfig, build_task_source


def test_the_builtin_agent_program_makes_the_rows_of_the_in_process_harness(
        kafka: KafkaConfig, learning_model_dir: Path, tmp_path: Path) -> None:
    [task, *_] = build_task_source(JsonlTasksConfig(path=learning_model_dir / "tasks.jsonl",
                                                    held_out_fraction=0.0)).tasks()
    job = RolloutJob(job_id="job", run_id="run", step=0, min_version=0, group_size=3, seed=5,
                     task=task.model_dump(mode="json"),
                     sampling=RolloutSampling(temperature=1.0, max_tokens=64, max_turns=3,
                                              context_budget=1024))
    # batch-invariant kernels: a row's logprobs do not depend on what else is in the batch
    engine = build_engine(Settings().engine, learning_model_dir, batch_invariant=True)
    producer = EventProducer(kafka, client_id="agent-rows-test")
    try:
        harness = Harness.on_engine(engine, HarnessConfig.of(job.sampling))
        in_process = asyncio.run(rollout_group(harness, task, group_size=job.group_size,
                                               cache=SandboxCache(), seed=job.seed))
        with RolloutEndpoint.serve(engine, producer, kafka, tmp_path) as endpoint:
            agent = asyncio.run(AgentGroups(AgentProgram(command=BUILTIN_AGENT), endpoint,
                                            SandboxCache(), tmp_path).group(job))
    finally:
        producer.close()
        engine.close()
    assert agent.dropped == {}
    for mine, theirs in zip(in_process.trajectories, agent.trajectories, strict=True):
        assert (theirs.reward, theirs.turns) == (mine.reward, mine.turns)
        for ours, logged in zip(unpack_segments(mine), unpack_segments(theirs), strict=True):
            # the same tokens, trained alike, at the same logprobs; the in-process window
            # also holds the closing tokens after its last turn, which nothing logs or trains
            n = len(logged)
            assert ours.token_ids[:n] == logged.token_ids
            assert ours.loss_mask[:n] == logged.loss_mask and not any(ours.loss_mask[n:])
            assert ours.logprobs[:n] == logged.logprobs
