"""The reward-hacking monitors (trainer/release/monitors.py) run by the online trainer: the
process that would train on a hack and ship it is the one that stops.

`MonitorWatch` follows `sessions` from the beginning in a thread (a reader outside any group,
as the console's tally is) and counts every generation per served version; the loop notes
each step's KL and clip fraction and the experiences it trained on (live acceptance per
version: the share with a positive reward), and each published release's held-out figures
(the gate's pass@1 of it and of its parent). `new_breaches()` checks the newest version with
traffic against the version before it, with the trainer's figures over its last
`TRAINER_WINDOW` steps, and returns what tripped that was not seen before. The loop pauses
the trainer, records them (`monitor_breach`) and holds its releases until an admin resumes
it, which acknowledges them: a breach trips once per version and monitor.
"""

from __future__ import annotations

import threading
from collections import deque

from ingest.config import KafkaConfig
from ingest.events import ExperienceReady, GenerationLogged
from ingest.topic_reader import TopicFollower
from trainer.release.config import MonitorSettings
from trainer.release.monitors import Breach, Monitors

TRAINER_WINDOW = 10  # steps: one step's KL spikes after a release; a run of them is a drift


class MonitorWatch:
    def __init__(self, kafka: KafkaConfig, settings: MonitorSettings) -> None:
        self.monitors = Monitors(settings)
        self._steps: deque[dict[str, float]] = deque(maxlen=TRAINER_WINDOW)
        self._verdicts: dict[int, list[int]] = {}  # version -> [experiences, accepted]
        self._held_out: dict[int, float] = {}  # version -> the gate's held-out pass@1
        self._seen: set[tuple[int, str]] = set()  # (version, monitor) already reported
        self._lock = threading.Lock()
        self._follower = TopicFollower(kafka, kafka.topics.sessions, GenerationLogged,
                                       self.add, name="monitor-watch")

    def start(self) -> MonitorWatch:
        self._follower.start()
        return self

    def add(self, generations: list[GenerationLogged]) -> None:
        with self._lock:
            for g in generations:
                self.monitors.add(g)

    def note_step(self, metrics: dict[str, float]) -> None:
        self._steps.append({"kl": metrics.get("kl", 0.0),
                            "clip_fraction": metrics.get("clipped", 0.0)})

    def note_experiences(self, experiences: list[ExperienceReady]) -> None:
        for e in experiences:
            counts = self._verdicts.setdefault(e.model_version, [0, 0])
            counts[0] += 1
            counts[1] += e.reward > 0

    def note_release(self, version: int, parent: int | None,
                     eval_summary: dict[str, float]) -> None:
        """The gate's held-out pass@1 of a published release and of the version it replaced."""
        for v, key in ((version, "candidate_pass_at_1"), (parent, "served_pass_at_1")):
            if v is not None and key in eval_summary:
                self._held_out.setdefault(v, eval_summary[key])

    def new_breaches(self) -> list[Breach]:
        """What trips now for the newest version with traffic that was not reported yet."""
        with self._lock:
            versions = sorted(self.monitors.versions)
            if not versions:
                return []
            version = versions[-1]
            parent = versions[-2] if len(versions) > 1 else None
            trainer = None
            if len(self._steps) == TRAINER_WINDOW:
                trainer = {k: sum(s[k] for s in self._steps) / TRAINER_WINDOW
                           for k in ("kl", "clip_fraction")}
            least = self.monitors.settings.min_generations
            acceptance = {v: accepted / n for v, (n, accepted) in self._verdicts.items()
                          if n >= least}
            found = self.monitors.check(version, parent=parent, trainer=trainer,
                                        acceptance=acceptance, held_out=self._held_out)
        fresh = [b for b in found if (b.version, b.monitor) not in self._seen]
        self._seen.update((b.version, b.monitor) for b in fresh)
        return fresh

    def close(self) -> None:
        self._follower.close()
