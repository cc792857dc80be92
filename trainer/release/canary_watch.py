"""The canary's decider: judged sessions of both arms into the sequential test, and its
decision published (trainer/release/canary_stage.py).

`CanaryWatch` follows `experiences` (every API replica runs one where `release.canary.decide`,
the default). A session verdict arrives as one experience per turn; once every turn of a
session is in, and all were served by one version, the session is one outcome: accepted (the
verdict was `accept`) and its reward (the last turn's, undiscounted). While a release is in its
canary (its row says "canary"), the outcomes of its sessions go to the candidate's arm and
those of its parent's sessions that began after the canary did to the incumbent's, each
session once; `CanaryTest` (trainer/release/canary.py) decides after every poll, and a
promotion or a rollback is published at once. A test that reaches `max_sessions` without a
decision marks the canary "held": it keeps its share until an admin promotes it or rolls it
back (`POST /admin/releases/{version}/promote|rollback`). The figures go to the `canary` row
for the console as they change.

Sessions are followed from the start of the topic, so a decider that restarts rebuilds the
test from the same sessions; of several deciders exactly one publishes (canary_stage).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from datetime import datetime

from sqlmodel import Session

from ingest.events import ExperienceReady
from ingest.sql import open_database
from ingest.topic_reader import TopicFollower
from trainer.release.canary import Arm, CanarySession, CanaryTest
from trainer.release.canary_stage import (
    TABLES,
    canary_run,
    note_figures,
    promote_canary,
    rollback_canary,
)
from trainer.release.config import ReleaseConfig
from trainer.release.pipeline import (
    ReleaseConflictError,
    canary_running,
    open_release_context,
)

log = logging.getLogger(__name__)
MAX_OPEN_SESSIONS = 50_000  # sessions with turns still to come: the oldest are forgotten
MAX_OUTCOMES = 200_000  # judged sessions kept for a canary that starts later in the topic


@dataclass(frozen=True)
class SessionOutcome:
    session_id: str
    version: int
    began: datetime  # its first turn's generation time
    accepted: bool
    reward: float


def session_outcome(turns: dict[int, ExperienceReady]) -> SessionOutcome | None:
    """The outcome of a session whose every turn is in `turns`, when one version served them
    all (else None: it spans a hot-swap and counts for neither arm)."""
    first = turns[min(turns)]
    last = turns[max(turns)]
    if len({e.model_version for e in turns.values()}) != 1:
        return None
    assert first.session_id is not None
    return SessionOutcome(first.session_id, first.model_version,
                          min(e.generated_at for e in turns.values()),
                          last.feedback_kind == "accept", last.reward)


@dataclass
class _Running:
    version: int
    parent: int
    started: datetime
    test: CanaryTest
    fed: set[str]
    held: bool = False
    noted: float = 0.0  # monotonic time the figures were last written


class CanaryWatch:
    """Follows `experiences`; decides the canary in progress (module doc)."""

    def __init__(self, config: ReleaseConfig, *, decided_by: str = "canary-test",
                 note_every_s: float = 1.0) -> None:
        self.config, self.settings = config, config.release.canary
        self.decided_by, self.note_every_s = decided_by, note_every_s
        self.db = open_database(config.database_url, TABLES)
        self._open: OrderedDict[str, dict[int, ExperienceReady]] = OrderedDict()
        self._outcomes: deque[SessionOutcome] = deque(maxlen=MAX_OUTCOMES)
        self._running: _Running | None = None
        self.decisions: list[dict[str, object]] = []
        self._follower = TopicFollower(config.kafka, config.kafka.topics.experiences,
                                       ExperienceReady, self.add, name="canary-watch")

    def start(self) -> CanaryWatch:
        self._follower.start()
        return self

    def close(self) -> None:
        self._follower.close()
        self.db.dispose()

    # ---- the follower's thread -----------------------------------------------------------
    def add(self, events: list[ExperienceReady]) -> None:
        """Collect each session's turns; a complete session becomes an outcome. Then decide."""
        for e in events:
            if e.session_id is None or e.turn is None or e.turns is None:
                continue  # feedback about one generation: not a session's verdict
            turns = self._open.setdefault(e.session_id, {})
            turns[e.turn] = e
            if len(turns) == e.turns:
                del self._open[e.session_id]
                outcome = session_outcome(turns)
                if outcome is not None:
                    self._outcomes.append(outcome)
                    self._feed(outcome)
            elif len(self._open) > MAX_OPEN_SESSIONS:
                self._open.popitem(last=False)
        self.check()

    def check(self) -> None:
        """Follow the release in its canary (if any) and publish the test's decision."""
        with Session(self.db) as session:
            release = canary_running(session)
        if release is None:
            self._running = None
            return
        running = self._running
        if running is None or running.version != release.version:
            run = canary_run(self.db, release, self.settings.share)
            running = self._running = _Running(release.version, run.parent, run.started_at,
                                               CanaryTest(self.settings), set())
            for outcome in self._outcomes:
                self._feed(outcome)
            log.info("canary v%d against v%d: %d sessions so far", running.version,
                     running.parent, len(running.fed))
        self._decide(running)

    def _feed(self, outcome: SessionOutcome) -> None:
        running = self._running
        if running is None or outcome.session_id in running.fed:
            return
        arm: Arm
        if outcome.version == running.version:
            arm = "candidate"
        elif outcome.version == running.parent and outcome.began >= running.started:
            arm = "incumbent"
        else:
            return
        running.fed.add(outcome.session_id)
        running.test.add(CanarySession(arm, outcome.accepted, outcome.reward))

    def _decide(self, running: _Running) -> None:
        decision = running.test.decide()
        figures = running.test.figures()
        if decision in ("promote", "rollback"):
            end = promote_canary if decision == "promote" else rollback_canary
            reason = describe(figures, decision)
            try:
                with open_release_context(self.config) as ctx:
                    end(ctx, running.version, decided_by=self.decided_by, reason=reason,
                        figures=figures)
            except ReleaseConflictError as exc:  # another decider, or an admin, was first
                log.info("canary v%d already ended: %s", running.version, exc)
            else:
                log.warning("canary v%d %s: %s", running.version, decision, reason)
                self.decisions.append({"version": running.version, "decision": decision,
                                       "figures": figures})
            self._running = None
            return
        now = time.monotonic()
        hold = decision == "hold" and not running.held
        if hold or now - running.noted >= self.note_every_s:
            running.noted, running.held = now, running.held or hold
            note_figures(self.db, running.version, figures,
                         status="held" if running.held else None,
                         reason=f"no decision after {self.settings.max_sessions} candidate "
                                f"sessions: held at its share until an admin decides"
                         if hold else None)


def describe(figures: dict[str, dict[str, float | str]], decision: str) -> str:
    """One line: each metric's arms, difference with its 95% interval, and decision."""
    parts = []
    for name, f in figures.items():
        parts.append(f"{name} {f['candidate_mean']:.3f} (n={f['candidate_sessions']}) vs "
                     f"{f['incumbent_mean']:.3f} (n={f['incumbent_sessions']}), "
                     f"diff {f['difference']:+.3f} [{f['low']:+.3f}, {f['high']:+.3f}]: "
                     f"{f['decision']}")
    return f"{decision}: " + "; ".join(parts)
