"""GRPO's task draw favours tasks still being learned."""

from __future__ import annotations

import random
from collections import Counter

from ingest.events import PackedArray
from ingest.rollout_events import RolloutGroup, RolloutTrajectory
from simulate.tasks import BuiltinTasksConfig, build_task_source
from trainer.bootstrap.task_sampler import TaskSampler

TASKS = build_task_source(BuiltinTasksConfig()).split("train")[:3]


def group(task_id: str, rewards: list[float]) -> RolloutGroup:
    one = PackedArray.pack([1], "int32")
    return RolloutGroup(group_id=task_id, task_id=task_id, policy_version=0, trajectories=[
        RolloutTrajectory(token_ids=one, loss_mask=PackedArray.pack([1], "uint8"),
                          logprobs=PackedArray.pack([0.0], "float32"), segment_lengths=one,
                          reward=r, turns=1, finished=True) for r in rewards])


def test_solved_tasks_are_drawn_at_the_floor_weight() -> None:
    sampler = TaskSampler(TASKS, floor=0.1, decay=0.5)
    solved, failing, half = TASKS
    sampler.observe([group(solved.task_id, [1.0] * 4), group(failing.task_id, [0.0] * 4),
                     group(half.task_id, [1.0, 1.0, 0.5, 0.0])])
    assert [sampler.weight(t) for t in TASKS] == [0.1, 1.0, 0.55]
    counts = Counter(t.task_id for t in sampler.draw(random.Random(0), 3000))
    assert counts[solved.task_id] < counts[half.task_id] < counts[failing.task_id]
    sampler.observe([group(solved.task_id, [0.0] * 4)])  # it regressed: half the way back
    assert sampler.weight(solved) == 0.1 + 0.9 * 0.5


def test_unseen_tasks_weigh_one() -> None:
    assert {TaskSampler(TASKS).weight(t) for t in TASKS} == {1.0}
