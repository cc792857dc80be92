"""Live acceptance and mean reward per served model version, from the joined feedback.

`RewardTally` follows the `experiences` topic (the join's output: every feedback event
joined with the generation it judges, carrying the `model_version` that served it and its
reward) from the beginning, in a thread, as a reader outside any group. It keeps, per
version, the totals and one point per `bucket_s` of join time: how many experiences, their
mean reward, the share with a positive reward (accepted). The console draws these.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

from ingest.config import KafkaConfig
from ingest.events import ExperienceReady
from ingest.topic_reader import TopicFollower


@dataclass
class Tally:
    experiences: int = 0
    reward_sum: float = 0.0
    accepted: int = 0

    def add(self, reward: float) -> None:
        self.experiences += 1
        self.reward_sum += reward
        self.accepted += reward > 0

    def figures(self) -> dict[str, float | int]:
        n = max(1, self.experiences)
        return {"experiences": self.experiences, "mean_reward": self.reward_sum / n,
                "acceptance": self.accepted / n}


@dataclass
class VersionTally:
    total: Tally = field(default_factory=Tally)
    buckets: dict[int, Tally] = field(default_factory=lambda: defaultdict(Tally))


class RewardTally:
    """A thread tallying `experiences` by model version; `snapshot()` is safe from any thread."""

    def __init__(self, config: KafkaConfig, *, bucket_s: float = 10.0) -> None:
        self.config, self.bucket_s = config, bucket_s
        self._versions: dict[int, VersionTally] = defaultdict(VersionTally)
        self._lock = threading.Lock()
        self._follower = TopicFollower(config, config.topics.experiences, ExperienceReady,
                                       self.add, name="reward-tally")

    def start(self) -> RewardTally:
        self._follower.start()
        return self

    def add(self, events: list[ExperienceReady]) -> None:
        with self._lock:
            for e in events:
                tally = self._versions[e.model_version]
                tally.total.add(e.reward)
                tally.buckets[int(e.joined_at.timestamp() // self.bucket_s)].add(e.reward)

    def snapshot(self) -> list[dict[str, object]]:
        """Per version, oldest first: totals and `points` [[unix s, mean reward, acceptance,
        experiences], ...] in time order."""
        with self._lock:
            return [{"version": v, **t.total.figures(),
                     "points": [[b * self.bucket_s, f["mean_reward"], f["acceptance"],
                                 f["experiences"]]
                                for b, bucket in sorted(t.buckets.items())
                                for f in [bucket.figures()]]}
                    for v, t in sorted(self._versions.items())]

    def close(self) -> None:
        self._follower.close()
