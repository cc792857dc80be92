"""The sessions x feedback join: rewarded experiences for the online trainer.

A consumer-group process (`flywheel join`) reads `sessions` and `feedback` and, for every
unique feedback event that meets its session (either may come first), produces one
`ExperienceReady` to `experiences`, keyed by an experience id derived from the event id. Each
poll is consume → match → produce:

1. consume: the poll's records, decoded (undecodable ones went to `dlq` with their bytes);
2. match, in one SQL transaction (`ingest.join_store`): store the sessions and the feedback
   ids not seen before, pair new feedback with stored sessions and new sessions with stored
   pending feedback;
3. produce the experiences of the new pairs and wait for the broker's acks, still inside the
   transaction, which records how far the acks reached (`join_progress`) and commits; then
   commit the Kafka offsets.

A crash before the commit rolls the transaction back and the records come again. Experiences
the broker acknowledged before such a crash would then be made a second time: so a member
that is assigned partitions first reads the tail of `experiences` from the offsets stored for
them, and does not produce again an experience it finds there. The topic holds each
experience once; consumers dedupe by key anyway (at-least-once everywhere).

Feedback may also be a verdict on a whole agent session (`session_id`, keyed by it): it
becomes one experience per turn of the session, once settled (`ingest.join_sessions`).
Entries unmatched after `expire_after_s` go to `dlq` with the reason. A deleted user's
sessions are dropped on arrival when generated before the deletion (`ingest.deletions`).

Several processes scale it out as one consumer group over one SQL state: every producer
partitions by CRC-32 of the key and both topics are keyed by generation_id, so a generation's
session and feedback share a partition number, which range assignment gives to one member.
The sweep matches the halves of a generation that two members stored while the partition
moved between them.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kafka import TopicPartition
from sqlalchemy import Connection

from ingest import join_store as store
from ingest.config import JoinSettings, KafkaConfig
from ingest.deletions import forget_user
from ingest.events import DeadLetter, ExperienceReady, FeedbackReceived, GenerationLogged, encode
from ingest.feedback_rewards import reward_for
from ingest.join_sessions import turn_plan
from ingest.log import Delivered, EventConsumer, EventProducer, ensure_topics, partition_for
from ingest.sql import open_database
from ingest.topic_reader import scan_keys

log = logging.getLogger(__name__)


@dataclass
class JoinStats:
    sessions: int = 0
    feedback: int = 0
    duplicates: int = 0
    experiences: int = 0
    expired_feedback: int = 0
    expired_sessions: int = 0
    rematched: int = 0
    dead_letters: int = 0
    verdicts: int = 0  # session verdicts among `feedback`
    verdicts_expanded: int = 0
    expired_verdicts: int = 0
    forgotten: int = 0  # sessions of deleted users dropped on arrival


class Join:
    """One member of the join's consumer group; `run()` until `stop` is set."""

    def __init__(self, kafka: KafkaConfig, settings: JoinSettings, *, database_url: str,
                 clock: Any = time.time) -> None:
        self.kafka = kafka
        self.settings = settings
        self.clock = clock
        self.stats = JoinStats()
        self.db = open_database(database_url, store.TABLES)
        self.producer = EventProducer(kafka, client_id="flywheel-join")
        topics = kafka.topics
        self.consumer = EventConsumer(
            kafka, group_id=settings.group_id, dlq=self.producer, name="join",
            types={topics.sessions: GenerationLogged, topics.feedback: FeedbackReceived},
            max_poll_records=settings.max_poll_records)
        self.consumer.on_assigned.append(self._assigned)
        self.owned: set[int] = set()  # input partitions (sessions = feedback) assigned here
        self.on_topic: set[str] = set()  # experience ids found by the recovery scan
        self._scan_due = False
        self._next_sweep = 0.0
        self._verdicts_due = -math.inf  # when a stored verdict next settles

    def _assigned(self, partitions: set[TopicPartition]) -> None:
        self.owned = {tp.partition for tp in partitions
                      if tp.topic == self.kafka.topics.feedback}
        self._scan_due = True  # after this poll: a previous owner's requests have landed
        self._verdicts_due = -math.inf  # verdicts a previous owner left pending

    def run(self, stop: threading.Event) -> JoinStats:
        try:
            while not stop.is_set():
                self.step()
        finally:
            self.close()
        return self.stats

    def step(self) -> int:
        """One poll: consume → match → produce (one transaction), then commit the offsets;
        the sweep when due. Returns the records handled."""
        records = self.consumer.poll(timeout_ms=self.settings.poll_timeout_ms)
        if self._scan_due:
            self.on_topic = self._produced_after_progress()
            self._scan_due = False
        if records:
            self.absorb(records)
            self.consumer.commit()  # what depends on the records is stored
        if self.clock() >= self._next_sweep:
            self.sweep()
        elif self.clock() >= self._verdicts_due:
            self.expand_verdicts()
        self.stats.dead_letters = self.consumer.dead_letters
        return len(records)

    def absorb(self, records: list[Delivered[Any]]) -> None:
        """Store the poll's sessions, new feedback and verdicts, and produce an experience per
        new match: new feedback meets sessions of this poll or stored ones; sessions of this
        poll meet stored pending feedback."""
        now = self.clock()
        sessions, feedback, verdicts, received = _split(records)
        with self.db.begin() as conn:
            # a deleted user's sessions that arrive late are dropped, with what waits for them
            forgotten = store.forgotten_among(conn, [d.event for d in sessions.values()])
            if forgotten:
                sessions = {g: d for g, d in sessions.items() if g not in forgotten}
                store.drop_feedback(conn, forgotten)
            unseen = store.unseen_feedback(conn, feedback)
            fresh = [d.event for e, d in feedback.items() if e in unseen]
            known = {g: d.event for g, d in sessions.items()}
            known.update(store.stored_sessions(conn, {f.key for f in fresh} - known.keys()))
            waiting = store.claim_feedback(conn, store.JoinFeedback.generation_id, sessions.keys())
            pairs = [(f, known[f.key]) for f in fresh if f.key in known]
            pairs += [(f, known[f.key]) for f in waiting]
            matched = {s.generation_id for _, s in pairs}
            store.add_sessions(conn, [
                store.SessionRow(g, d.raw.decode(), now, g in matched)
                for g, d in sessions.items()], [d.event for d in sessions.values()])
            # a matched event's payload is never read again: only pending ones keep it
            store.add_feedback(conn, [store.FeedbackRow(
                f.event_id, f.key, "" if f.key in known or f.key in forgotten
                else feedback[f.event_id].raw.decode(), now,
                store.MATCHED if f.key in known else
                store.DELETED if f.key in forgotten else store.PENDING) for f in fresh])
            store.sessions_matched(conn, matched - sessions.keys())
            new_verdicts = store.add_verdicts(
                conn, [(d.event, d.raw, d.partition) for d in verdicts.values()], now)
            if new_verdicts:
                self._verdicts_due = min(self._verdicts_due, now + self.settings.session_settle_s)
            rewards = self.settings.rewards
            self._produce(conn, [(self._source(s.generation_id),
                                  ExperienceReady.of(s, f, reward_for(f, rewards)))
                                 for f, s in pairs])
        self.stats.sessions += len(sessions)
        self.stats.forgotten += len(forgotten)
        self.stats.feedback += len(fresh) + len(new_verdicts)
        self.stats.verdicts += len(new_verdicts)
        self.stats.duplicates += received - len(fresh) - len(new_verdicts)

    def _produce(self, conn: Connection, experiences: Sequence[tuple[int, ExperienceReady]]
                 ) -> None:
        """Produce `experiences` (each with its source: the input partition whose owner makes
        it) and wait for the acks; record, in `conn`'s transaction, the highest offset acked
        per source and experiences partition. One the recovery scan found is not sent again."""
        sending = [(source, x) for source, x in experiences if x.experience_id not in self.on_topic]
        if not sending:
            return
        acked = self.producer.deliver(
            self.kafka.topics.experiences, [(x.experience_id, encode(x)) for _, x in sending],
            timeout_s=self.kafka.delivery_timeout_ms / 1000)
        reached: dict[tuple[int, int], int] = {}
        for (source, _), meta in zip(sending, acked, strict=True):
            key = (source, meta.partition)
            reached[key] = max(reached.get(key, -1), meta.offset)
        store.record_progress(conn, reached)
        self.stats.experiences += len(sending)

    def _source(self, generation_id: str) -> int:
        """The input partition of a generation (sessions and feedback are co-partitioned)."""
        return partition_for(generation_id.encode(),
                             self.producer.partitions(self.kafka.topics.feedback))

    def _produced_after_progress(self) -> set[str]:
        """The experience ids on the topic past the offsets stored for this member's
        partitions: what a predecessor produced in a transaction that never committed (and
        whatever others produced since). A source's experiences land on a partition in the
        order they are produced, so the scan starts, per experiences partition, at the
        lowest stored offset among the sources (the beginning where one has none)."""
        if not self.owned:
            return set()
        with self.db.connect() as conn:
            stored = store.progress(conn, self.owned)
        reached: dict[int, dict[int, int]] = {}
        for source, partition, offset in stored:
            reached.setdefault(partition, {})[source] = offset
        count = self.producer.partitions(self.kafka.topics.experiences)
        starts = {q: min(reached.get(q, {}).get(s, -1) + 1 for s in self.owned)
                  for q in range(count)}
        return scan_keys(self.kafka, self.kafka.topics.experiences, starts)

    def sweep(self) -> None:
        """Every `sweep_every_s`: match what two members left pending, expand the settled
        session verdicts, expire what stayed unmatched."""
        self.forget_again()
        self.rematch()
        self.expand_verdicts()
        self.expire()
        self._next_sweep = self.clock() + self.settings.sweep_every_s

    def forget_again(self) -> None:
        """Apply again the deletions younger than `expire_after_s` (`ingest.deletions`): a
        transaction that stored a deleted user's session while the deletion ran (on
        PostgreSQL the two do not wait for each other) is undone here."""
        now = self.clock()
        with self.db.begin() as conn:
            for user_id, before in store.forgotten_since(
                    conn, now - self.settings.expire_after_s):
                forget_user(conn, user_id, before, now)

    def rematch(self) -> None:
        """Match pending feedback whose session is stored after all. Sessions and feedback are
        co-partitioned (`ingest.log.partition_for`), so one member sees both halves of a
        generation; only while a partition moves between members can each store its half
        before seeing the other's, and this sweep (by the partition's owner) closes that gap."""
        with self.db.begin() as conn:
            found = dict(store.pending_with_sessions(
                conn, lambda generation_id: self._source(generation_id) in self.owned))
            if not found:
                return
            claimed = store.claim_feedback(conn, store.JoinFeedback.event_id, found)
            store.sessions_matched(conn, {found[f.event_id].generation_id for f in claimed})
            rewards = self.settings.rewards
            self._produce(conn, [(self._source(f.key), ExperienceReady.of(
                found[f.event_id], f, reward_for(f, rewards))) for f in claimed])
        self.stats.rematched += len(claimed)
        if claimed:
            log.info("join: %d pending feedback events met sessions stored meanwhile", len(claimed))

    def expand_verdicts(self, sources: Collection[int] | None = None) -> tuple[int, int]:
        """Expand the settled session verdicts of `sources` (default: this member's input
        partitions) that have generations to judge: claim them and produce one experience
        per turn (one transaction). Returns (verdicts, experiences)."""
        now, settle = self.clock(), self.settings.session_settle_s
        rewards, discount = self.settings.rewards, self.settings.session_discount
        with self.db.begin() as conn:
            pending = store.pending_verdicts(conn, self.owned if sources is None else sources)
            self._verdicts_due = min((p.first_seen + settle for p in pending
                                      if p.first_seen + settle > now), default=math.inf)
            due = [p for p in pending if p.first_seen + settle <= now]
            if not due:
                return 0, 0
            by_session = store.session_generations(conn, {p.verdict.key for p in due})
            stored = store.stored_sessions(conn, {g for ids in by_session.values() for g in ids})
            plans = {p.verdict.event_id: (p, turn_plan(
                p.verdict, [stored[g] for g in by_session.get(p.verdict.key, ()) if g in stored],
                reward_for(p.verdict, rewards), discount)) for p in due}
            claimed = store.claim_verdicts(conn, [e for e, (_, plan) in plans.items() if plan])
            experiences = [(p.source, ExperienceReady.of(g, p.verdict, reward, turn=t.turn,
                                                         turns=t.turns))
                           for e in claimed for p, plan in [plans[e]] for g, t, reward in plan]
            store.sessions_matched(conn, {x.generation_id for _, x in experiences})
            self._produce(conn, experiences)
        self.stats.verdicts_expanded += len(claimed)
        return len(claimed), len(experiences)

    def expire(self) -> None:
        """Send entries unmatched for `expire_after_s` to the DLQ, then forget them."""
        cutoff = self.clock() - self.settings.expire_after_s
        window = f"{self.settings.expire_after_s:.0f}s"
        topics = self.kafka.topics
        with self.db.connect() as conn:
            stale_feedback = store.stale_pending(conn, store.JoinFeedback, cutoff)
            stale_verdicts = store.stale_pending(conn, store.JoinVerdict, cutoff)
            old_sessions = store.stale_sessions(conn, cutoff)
        if not (stale_feedback or stale_verdicts or old_sessions):
            return  # most sweeps: no flush, no write transaction
        letters = [(topics.feedback, g, p, f"unmatched: no session for generation {g} "
                    f"within {window}") for _, g, p in stale_feedback]
        letters += [(topics.feedback, s, p, f"unmatched: no generation of session {s} "
                     f"within {window}") for _, s, p in stale_verdicts]
        letters += [(topics.sessions, g, p, f"unmatched: no feedback for generation {g} "
                     f"within {window}") for g, p, matched in old_sessions if not matched]
        self.producer.deliver(topics.dlq, [(key, encode(DeadLetter.of(
            topic=topic, raw=payload.encode(), key=key.encode(), reason=reason,
            consumer="join"))) for topic, key, payload, reason in letters],
            timeout_s=self.kafka.delivery_timeout_ms / 1000)
        with self.db.begin() as conn:
            store.expire_pending(conn, store.JoinFeedback, [e for e, _, _ in stale_feedback])
            store.expire_pending(conn, store.JoinVerdict, [e for e, _, _ in stale_verdicts])
            store.forget_sessions(conn, [g for g, _, _ in old_sessions])
        self.stats.expired_feedback += len(stale_feedback)
        self.stats.expired_verdicts += len(stale_verdicts)
        self.stats.expired_sessions += sum(1 for *_, matched in old_sessions if not matched)

    def close(self) -> None:
        try:
            self.consumer.close()
        finally:
            self.producer.close()
            self.db.dispose()


def _split(records: list[Delivered[Any]]) -> tuple[
        dict[str, Delivered[Any]], dict[str, Delivered[Any]], dict[str, Delivered[Any]], int]:
    """A poll's sessions by generation id, its feedback about one generation and its session
    verdicts by event id (a repeat within the poll kept once), and how many feedback records
    it held (repeats included)."""
    sessions: dict[str, Delivered[Any]] = {}
    feedback: dict[str, Delivered[Any]] = {}
    verdicts: dict[str, Delivered[Any]] = {}
    received = 0
    for d in records:
        event = d.event
        if isinstance(event, GenerationLogged):
            sessions[event.generation_id] = d
        else:
            received += 1
            (feedback if event.session_id is None else verdicts)[event.event_id] = d
    return sessions, feedback, verdicts, received


def run_join(kafka: KafkaConfig, settings: JoinSettings, *, database_url: str,
             stop: threading.Event) -> JoinStats:
    """The `flywheel join` process body: run until `stop`, then print the counts as JSON."""
    ensure_topics(kafka)
    join = Join(kafka, settings, database_url=database_url)
    print(f"join: group {settings.group_id} on {kafka.bootstrap}", flush=True)
    stats = join.run(stop)
    print(json.dumps({"join": asdict(stats)}), flush=True)
    return stats
