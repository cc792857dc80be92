"""Session verdicts in the join: one verdict about a whole agent session, one experience per turn.

A coding agent's session is several generations (one chat completion per model turn), all
logged with one `session_id`. The product may judge it as a whole: a `FeedbackReceived` with
`session_id` instead of `generation_id` (a verdict), keyed and partitioned on `feedback` by
the session id. Sessions are partitioned by generation id, so the session's generations are
spread over partitions and join members: every member indexes the generations it stores by
session (`join_session_turn`) in the SQL state they share, and stores the verdicts of its
partitions, pending (`join_verdict`, deduped by event id).

A verdict is expanded once it has been stored for `session_settle_s` (the sessions log may
lag it), by the member that owns its partition (`Join.expand_verdicts`): that member claims
it and, in the same transaction, produces one experience per turn. The turns are the
session's generations stored by then and generated no later than the verdict
(`occurred_at`), ordered by `created_at` then generation id; turn k of T is paid
`reward_for(verdict) * session_discount ** (T - 1 - k)` and keyed
`experience_id_for(event_id, generation_id)`. The generations count as matched. A verdict
with no generation stored stays pending, retried by every sweep, and goes to the DLQ after
`expire_after_s`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from ingest.events import FeedbackReceived, GenerationLogged
from ingest.feedback_rewards import turn_rewards
from ingest.join_store import as_utc


class Turn(NamedTuple):
    """Where a session verdict's experience sits in its session: turn `turn` (0-based, in
    generation order) of `turns`."""

    turn: int
    turns: int


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
    """Each covered generation with its turn and reward (`ingest.feedback_rewards.turn_rewards`)."""
    turns = covered_turns(verdict, generations)
    rewards = turn_rewards(reward, len(turns), discount)
    return [(g, Turn(k, len(turns)), r)
            for k, (g, r) in enumerate(zip(turns, rewards, strict=True))]
