"""The trainer's side of the fleet on a real broker: a step's jobs go out the moment the
version they need is announced, without waiting for the trainer to ask for groups."""

from __future__ import annotations

from pathlib import Path

import torch

from ingest.config import KafkaConfig
from ingest.rollout_events import JudgeConfig, RewardConfig, RolloutJob
from ingest.topic_reader import read_all
from kernels.delta.store import artifact_store_config, build_artifact_store
from simulate.tasks import BuiltinTasksConfig, build_task_source
from tests.integration.helpers import wait_for
from trainer.bootstrap.config import BootstrapSettings
from trainer.bootstrap.fleet import RolloutFleet
from trainer.bootstrap.policy_publisher import PolicyPublisher
from trainer.bootstrap.task_sampler import TaskSampler


def test_a_steps_jobs_go_out_when_the_version_they_need_is_announced(
        kafka: KafkaConfig, tmp_path: Path) -> None:
    # async, staleness 1, 4 groups a step; a judge's scoring travels with every job
    rewards = RewardConfig(judge_weight=0.5, judge=JudgeConfig(base_url="http://judge/v1",
                                                               model="judge-1"))
    cfg = BootstrapSettings(rewards=rewards)
    store = build_artifact_store(artifact_store_config(str(tmp_path / "policy")))
    publisher = PolicyPublisher(store, kafka).start(0, {"w": torch.zeros(8)}, {})
    tasks = TaskSampler(build_task_source(BuiltinTasksConfig()).split("train"))
    fleet = RolloutFleet(kafka, cfg, tasks, publisher, first_step=0, steps=5)

    def steps_out() -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for job in read_all(kafka, kafka.topics.rollout_jobs, RolloutJob):
            if job.run_id == fleet.run_id:
                assert job.rewards == rewards
                out.setdefault(job.step, []).append(job.min_version)
        return out

    try:
        assert steps_out() == {}  # v0 was announced before the fleet; nobody has waited yet
        publisher.publish(1, {"w": torch.ones(8)})
        # v1 lets steps 0-2 start (step - staleness <= 1); the trainer never called take_step
        wait_for(lambda: len(steps_out().get(2, [])) == 4, "the jobs v1 lets start")
        assert steps_out() == {0: [0] * 4, 1: [0] * 4, 2: [1] * 4}
        assert fleet.ledger.summary()["issued"] == 12
    finally:
        fleet.close()
        publisher.close()
