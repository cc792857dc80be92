"""Session verdicts in the join: one verdict about a whole agent session, one experience per turn.

A coding agent's session is several generations (one chat completion per model turn), all
logged with one `session_id`. The product may judge it as a whole: a `FeedbackReceived` with
`session_id` instead of `generation_id` (a verdict), keyed and partitioned on `feedback` by
the session id. Sessions are partitioned by generation id, so the session's generations are
spread over partitions and join members: every member indexes the generations it stores by
session (`join_session_turn`, `ingest.join_sessions_state`) in the SQL state they share, and
stores the verdicts of its partitions, pending (`join_verdict`, deduped by event id).

A verdict is expanded once it has been stored for `session_settle_s` (the sessions log may
lag it), by the member that owns its partition: that member claims it (`UPDATE … WHERE state
= 'pending' RETURNING`, so two members never both expand it) and, in the same transaction,
puts one experience per turn in its outbox. The turns are the session's generations stored by
then and generated no later than the verdict (`occurred_at`), ordered by `created_at` then
generation id; turn k of T is paid `reward_for(verdict) * session_discount ** (T - 1 - k)`
and keyed `experience_id_for(event_id, generation_id)`. From the outbox on they are like any
experience: sent, acked, marked produced, rebuilt after a crash (`join_outbox_turn` says which
generation and turn each is) and found by the restart's tail scan. The generations count as
matched. A verdict with no generation stored stays pending, retried by every sweep, and goes to
the DLQ after `expire_after_s`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

from sqlalchemy import Connection, Engine

from ingest.config import JoinSettings
from ingest.events import FeedbackReceived, GenerationLogged
from ingest.experience_json import Turn
from ingest.join_outbox import Match
from ingest.join_sessions_state import (
    PendingVerdict,
    as_utc,
    claim_verdicts,
    pending_verdicts,
    session_generations,
    store_turns,
    store_verdicts,
)
from ingest.join_state import sessions_matched, writing
from ingest.log import Delivered
from ingest.rewards import reward_for, turn_rewards

# an experience to store: the feedback, its generation, its reward, and a verdict's turn
Judged = tuple[FeedbackReceived, Match, float, Turn | None]
# the join's stored sessions by generation id (from memory, else SQL), and its outbox writer
Lookup = Callable[[Connection, set[str]], dict[str, Match]]
Store = Callable[[Connection, dict[int, list[Judged]], dict[str, bytes]], None]
Plan = list[tuple[GenerationLogged, Turn, float]]


def covered_turns(verdict: FeedbackReceived, generations: Sequence[GenerationLogged]
                  ) -> list[GenerationLogged]:
    """The generations a verdict judges, in turn order: those generated no later than it (a
    turn after the verdict was not judged), by `created_at`, then generation id."""
    occurred = as_utc(verdict.occurred_at)
    covered = [g for g in generations if as_utc(g.created_at) <= occurred]
    return sorted(covered, key=lambda g: (as_utc(g.created_at), g.generation_id))


def turn_plan(verdict: FeedbackReceived, generations: Sequence[GenerationLogged],
              reward: float, discount: float) -> Plan:
    """Each covered generation with its turn and reward (`ingest.rewards.turn_rewards`)."""
    turns = covered_turns(verdict, generations)
    rewards = turn_rewards(reward, len(turns), discount)
    return [(g, Turn(k, len(turns)), r)
            for k, (g, r) in enumerate(zip(turns, rewards, strict=True))]


class SessionVerdicts:
    """A join member's session verdicts: stored in its poll's transaction, expanded into its
    outbox once settled (`expand`). `due` is when one it stored next settles: the join
    expands then, and in every sweep (verdicts a predecessor stored, sessions that lagged)."""

    def __init__(self, db: Engine, settings: JoinSettings, clock: Callable[[], float], *,
                 lookup: Lookup, store: Store) -> None:
        self.db, self.settings, self.clock = db, settings, clock
        self.lookup, self.store = lookup, store
        self.due = -math.inf  # look at once: a predecessor may have left some

    def absorb(self, conn: Connection, sessions: Sequence[GenerationLogged],
               verdicts: Sequence[Delivered[Any]], now: float) -> int:
        """Index `sessions` by session id and store the new `verdicts` (from the poll's
        records: their partition is their source); returns how many verdicts were new."""
        store_turns(conn, sessions)
        if not verdicts:
            return 0
        fresh = store_verdicts(conn, [(d.event, d.raw, d.partition) for d in verdicts], now)
        if fresh:
            self.due = min(self.due, now + self.settings.session_settle_s)
        return len(fresh)

    def expand(self, owned: Collection[int]) -> tuple[int, int]:
        """Expand the settled verdicts of input partitions `owned` that have generations to
        judge: claim them and store their experiences (one transaction). Returns (verdicts,
        experiences)."""
        now, settle = self.clock(), self.settings.session_settle_s
        with writing(self.db) as conn:
            pending = pending_verdicts(conn, owned)
            self.due = min((p.first_seen + settle for p in pending
                            if p.first_seen + settle > now), default=math.inf)
            due = [p for p in pending if p.first_seen + settle <= now]
            by_session, matches = self._generations(conn, due)
            plans = self._plans(due, by_session, matches)
            claimed = claim_verdicts(conn, list(plans))
            judged: dict[int, list[Judged]] = {}
            covered: set[str] = set()
            for event_id, (p, plan) in plans.items():
                if event_id in claimed:  # else another member expanded it first
                    judged.setdefault(p.source, []).extend(
                        (p.verdict, matches[g.generation_id], reward, turn)
                        for g, turn, reward in plan)
                    covered.update(g.generation_id for g, _, _ in plan)
            sessions_matched(conn, covered)
            self.store(conn, judged, {e: plans[e][0].payload.encode() for e in claimed})
        for generation_id in covered:
            matches[generation_id].matched = True
        return len(claimed), sum(len(plans[e][1]) for e in claimed)

    def _generations(self, conn: Connection, due: Sequence[PendingVerdict]
                     ) -> tuple[dict[str, list[str]], dict[str, Match]]:
        """The generation ids indexed for each session `due` judges, and those generations
        stored (their sessions), by generation id."""
        if not due:
            return {}, {}
        by_session = session_generations(conn, {p.verdict.key for p in due})
        return by_session, self.lookup(conn, {g for ids in by_session.values() for g in ids})

    def _plans(self, due: Sequence[PendingVerdict], by_session: dict[str, list[str]],
               matches: dict[str, Match]) -> dict[str, tuple[PendingVerdict, Plan]]:
        """Each due verdict with something to judge, by event id, with its turns."""
        rewards, discount = self.settings.rewards, self.settings.session_discount
        plans: dict[str, tuple[PendingVerdict, Plan]] = {}
        for p in due:
            generations = [matches[g].session for g in by_session.get(p.verdict.key, ())
                           if g in matches]
            plan = turn_plan(p.verdict, generations, reward_for(p.verdict, rewards), discount)
            if plan:
                plans[p.verdict.event_id] = (p, plan)
        return plans
