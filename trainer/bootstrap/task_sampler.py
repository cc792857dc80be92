"""Which tasks GRPO's next groups are made of: the ones still being learned, mostly.

A group whose G episodes all pass gives GRPO no signal (every advantage is 0) and costs as much
as any other. Once mid-training has taught the train split, most tasks are like that: in one
bootstrap run, 3-8 of the 32 episodes of a step were trained on. So a task's weight follows
how often its recent episodes passed: `floor` when they all did, 1 when none did, linear
between, from an exponential mean over its groups (`decay` per group); a task never drawn
yet weighs 1. Tasks that always fail keep weight 1: they are where a first success is worth
the most.

    sampler = TaskSampler(tasks, floor=0.1)
    picked = sampler.draw(rng, 4)
    sampler.observe(groups)
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

from ingest.rollout_events import RolloutGroup
from simulate.tasks import Task


class TaskSampler:
    def __init__(self, tasks: Sequence[Task], *, floor: float = 0.1, decay: float = 0.5) -> None:
        if not tasks:
            raise ValueError("GRPO needs at least one task")
        self.tasks = list(tasks)
        self.floor, self.decay = floor, decay
        self.solved: dict[str, float] = {}  # task id -> recent share of episodes passed

    def weight(self, task: Task) -> float:
        rate = self.solved.get(task.task_id)
        return 1.0 if rate is None else self.floor + (1.0 - self.floor) * (1.0 - rate)

    def draw(self, rng: random.Random, count: int) -> list[Task]:
        return rng.choices(self.tasks, weights=[self.weight(t) for t in self.tasks], k=count)

    def observe(self, groups: Iterable[RolloutGroup]) -> None:
        for group in groups:
            rate = sum(t.reward >= 1.0 for t in group.trajectories) / len(group.trajectories)
            old = self.solved.get(group.task_id)
            self.solved[group.task_id] = rate if old is None else (
                self.decay * old + (1.0 - self.decay) * rate)
