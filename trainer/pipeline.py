"""Rollout workers and the trainer running at the same time, with bounded staleness.

Rollout groups are numbered by the trainer step that will consume them: step k takes groups
`k * groups_per_step ... (k + 1) * groups_per_step - 1`. A worker may start a group for step
k only with weights of version >= k - max_staleness; when the trainer has not published them
yet, the worker blocks until it does (it waits for fresh weights; nothing is discarded). So a
group made by version v is always consumed at step k with k - v <= max_staleness, and
`submit` checks that invariant again (admission control) and raises if it were ever broken.

`max_staleness = 0` is the synchronous schedule: rollouts for step k need the weights of step
k - 1's update, so the trainer and the rollout side take turns. Larger values let them overlap.

    gate = StalenessGate(groups_per_step=4, max_staleness=1)
    slot = gate.claim()                          # worker: which group to make next
                                                 # (or claim_batch(n): several of one step)
    version = gate.wait_for_weights(slot.step)   # blocks until version >= step - staleness
    gate.submit(slot, group)                     # admission check, then queued for the step
    groups = gate.take_step(k)                   # trainer: blocks until step k is complete
    gate.publish(k + 1)                          # trainer: new weights are out
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Generic, TypeVar

G = TypeVar("G")


class StaleRolloutError(RuntimeError):
    """A group was offered for a step its policy version is too old for (a scheduling bug)."""


class PipelineClosedError(RuntimeError):
    """The pipeline was closed while a worker or the trainer waited on it."""


@dataclass(frozen=True)
class Slot:
    index: int  # global group number
    step: int  # the trainer step that will consume it


@dataclass
class IdleClock:
    """Accumulated seconds a side spent blocked on the other."""

    idle_s: float = 0.0
    started: float = field(default_factory=time.monotonic)

    def fraction(self) -> float:
        return self.idle_s / max(1e-9, time.monotonic() - self.started)


class StalenessGate(Generic[G]):
    """The one lock-protected meeting point of rollout workers and the trainer."""

    def __init__(self, *, groups_per_step: int, max_staleness: int, version: int = 0) -> None:
        if groups_per_step < 1 or max_staleness < 0:
            raise ValueError("groups_per_step >= 1 and max_staleness >= 0 are required")
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self._version = version
        self._first_step = version  # step numbers start at the initial version
        self._next_slot = version * groups_per_step
        self._ready: dict[int, list[tuple[int, G]]] = defaultdict(list)
        self._cond = threading.Condition()
        self._closed = False
        self.rollout_idle = IdleClock()
        self.trainer_idle = IdleClock()
        self.admitted = 0

    @property
    def version(self) -> int:
        return self._version

    def claim(self) -> Slot:
        return self.claim_batch(1)[0]

    def claim_batch(self, limit: int) -> list[Slot]:
        """Up to `limit` consecutive slots of one step, so that a worker can make them
        together with one set of weights (slots of two steps could wait on each other)."""
        with self._cond:
            self._raise_if_closed()
            first = self._next_slot
            room = self.groups_per_step - first % self.groups_per_step
            self._next_slot += min(limit, room)
            return [Slot(i, i // self.groups_per_step) for i in range(first, self._next_slot)]

    def min_version(self, step: int) -> int:
        return max(self._first_step, step - self.max_staleness)

    def wait_for_weights(self, step: int) -> int:
        """Block until the published version may make groups for `step`; return that version."""
        with self._cond:
            start = time.monotonic()
            while self._version < self.min_version(step):
                self._raise_if_closed()
                self._cond.wait(timeout=0.5)
            self.rollout_idle.idle_s += time.monotonic() - start
            return self._version

    def submit(self, slot: Slot, group: G, *, policy_version: int) -> None:
        """Admit a finished group for its step; raises `StaleRolloutError` if it is too old."""
        if policy_version < self.min_version(slot.step):
            raise StaleRolloutError(f"group {slot.index} made by version {policy_version} is "
                                    f"too stale for step {slot.step} (max staleness "
                                    f"{self.max_staleness})")
        with self._cond:
            self._ready[slot.step].append((slot.index, group))
            self.admitted += 1
            self._cond.notify_all()

    def take_step(self, step: int) -> list[G]:
        """Block until every group of `step` is in; return them in slot order."""
        with self._cond:
            start = time.monotonic()
            while len(self._ready[step]) < self.groups_per_step:
                self._raise_if_closed()
                self._cond.wait(timeout=0.5)
            self.trainer_idle.idle_s += time.monotonic() - start
            return [group for _, group in sorted(self._ready.pop(step), key=lambda x: x[0])]

    def publish(self, version: int) -> None:
        with self._cond:
            if version < self._version:
                raise ValueError(f"version {version} is older than {self._version}")
            self._version = version
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise PipelineClosedError("pipeline closed")
