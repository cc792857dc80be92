"""The sessions x feedback join: rewarded experiences for the online trainer.

A consumer-group process (`flywheel join`) reads `sessions` and `feedback`, matches them by
generation_id in SQL (either may come first), and for every unique feedback event that meets
its session produces one `ExperienceReady` to `experiences`, keyed by an experience id derived
from the event id. Each poll runs: store records and matches (one SQL transaction, the
experiences go to an outbox) -> produce the outbox, await acks, mark it -> commit offsets.
A crash anywhere re-delivers records that the SQL ledger then ignores; outbox rows produced
but not marked are found on restart by scanning the topic's tail, so nothing counts twice.
Entries unmatched after `expire_after_s` go to `dlq` with the reason; undecodable records go
there with their raw bytes (EventConsumer).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from kafka import KafkaConsumer, TopicPartition
from sqlalchemy import Connection, delete, select, update

from ingest.config import JoinSettings, KafkaConfig
from ingest.events import (
    DeadLetter,
    ExperienceReady,
    FeedbackReceived,
    GenerationLogged,
    decode,
    encode,
    experience_id_for,
)
from ingest.join_state import (
    EXPIRED,
    MATCHED,
    PENDING,
    JoinExperience,
    JoinFeedback,
    JoinProgress,
    JoinSession,
    existing_ids,
    insert_new,
    mark_produced,
    open_state,
)
from ingest.log import Delivered, EventConsumer, EventProducer, ensure_topics
from ingest.rewards import reward_for

log = logging.getLogger(__name__)


@dataclass
class JoinStats:
    sessions: int = 0
    feedback: int = 0
    duplicates: int = 0
    experiences: int = 0
    expired_feedback: int = 0
    expired_sessions: int = 0
    dead_letters: int = 0


def build_experience(session: GenerationLogged, feedback: FeedbackReceived,
                     reward: float) -> ExperienceReady:
    return ExperienceReady(
        experience_id=experience_id_for(feedback.event_id), generation_id=session.generation_id,
        feedback_event_ids=[feedback.event_id], feedback_kind=feedback.kind,
        feedback_value=feedback.value, reward=reward, model_version=session.model_version,
        model_sha256=session.model_sha256, prompt_token_ids=session.prompt_token_ids,
        completion_token_ids=session.completion_token_ids, logprobs=session.logprobs,
        routed_experts=session.routed_experts, sampling=session.sampling,
        finish_reason=session.finish_reason, generated_at=session.created_at)


class Join:
    """One member of the join's consumer group; `run()` until `stop` is set."""

    def __init__(self, kafka: KafkaConfig, settings: JoinSettings, *, database_url: str,
                 clock: Any = time.time) -> None:
        self.kafka = kafka
        self.settings = settings
        self.clock = clock
        self.stats = JoinStats()
        self.db = open_state(database_url)
        self.producer = EventProducer(kafka, client_id="flywheel-join")
        topics = kafka.topics
        self.consumer = EventConsumer(
            kafka, group_id=settings.group_id, dlq=self.producer, name="join",
            types={topics.sessions: GenerationLogged, topics.feedback: FeedbackReceived},
            max_poll_records=settings.max_poll_records)
        self._next_sweep = 0.0
        self._recovered = False

    def run(self, stop: threading.Event) -> JoinStats:
        try:
            while not stop.is_set():
                self.step()
        finally:
            self.close()
        return self.stats

    def step(self) -> int:
        """One poll: store, match, produce, commit; returns the records it handled."""
        records = self.consumer.poll(timeout_ms=self.settings.poll_timeout_ms)
        if not self._recovered:  # after the first poll: the group is joined, the old
            self.recover()        # member's in-flight produce requests have landed
        if records:
            self.absorb(records)
        self.drain()
        if records:
            self.consumer.commit()
        if self.clock() >= self._next_sweep:
            self.expire()
            self._next_sweep = self.clock() + self.settings.sweep_every_s
        self.stats.dead_letters = self.consumer.dead_letters
        return len(records)

    def absorb(self, records: list[Delivered[Any]]) -> None:
        """Store sessions and new feedback, and queue an experience per new match."""
        now = self.clock()
        sessions = {d.event.generation_id: d.event for d in records
                    if isinstance(d.event, GenerationLogged)}
        feedback = {d.event.event_id: d.event for d in records
                    if isinstance(d.event, FeedbackReceived)}
        with self.db.begin() as conn:
            known = existing_ids(conn, JoinFeedback.event_id, feedback)
            fresh = [f for e, f in feedback.items() if e not in known]
            self.stats.duplicates += sum(isinstance(d.event, FeedbackReceived)
                                         for d in records) - len(fresh)
            insert_new(self.db, JoinSession, [
                {"generation_id": g, "payload": encode(s).decode(), "first_seen": now}
                for g, s in sessions.items()], conn)
            insert_new(self.db, JoinFeedback, [
                {"event_id": f.event_id, "generation_id": f.generation_id,
                 "payload": encode(f).decode(), "first_seen": now, "state": PENDING}
                for f in fresh], conn)
            self.stats.sessions += len(sessions)
            self.stats.feedback += len(fresh)
            self.match(conn, set(sessions) | {f.generation_id for f in fresh},
                       sessions, feedback)

    def match(self, conn: Connection, generation_ids: set[str],
              sessions: dict[str, GenerationLogged],
              feedback: dict[str, FeedbackReceived]) -> None:
        """Queue an experience for every pending feedback of `generation_ids` whose session
        is stored; records of this poll are used as decoded, older ones decoded from SQL."""
        ids = sorted(generation_ids)
        for start in range(0, len(ids), 5000):
            chunk = ids[start:start + 5000]
            rows = conn.execute(
                select(JoinFeedback.event_id, JoinFeedback.payload, JoinSession.generation_id,
                       JoinSession.payload)
                .join(JoinSession, JoinSession.generation_id == JoinFeedback.generation_id)
                .where(JoinFeedback.state == PENDING, JoinFeedback.generation_id.in_(chunk))
            ).all()
            if rows:
                self._queue_matches(conn, rows, dict(sessions), feedback)

    def _queue_matches(self, conn: Connection, rows: list[Any],
                       sessions: dict[str, GenerationLogged],
                       feedback: dict[str, FeedbackReceived]) -> None:
        outbox, matched_ids = [], []
        for event_id, feedback_raw, generation_id, session_raw in rows:
            session = sessions.get(generation_id)
            if session is None:
                session = sessions[generation_id] = decode(GenerationLogged, session_raw)
            fb = feedback.get(event_id) or decode(FeedbackReceived, feedback_raw)
            experience = build_experience(session, fb, reward_for(fb, self.settings.rewards))
            outbox.append({"experience_id": experience.experience_id, "event_id": event_id,
                           "generation_id": generation_id,
                           "payload": encode(experience).decode(), "produced": False})
            matched_ids.append(event_id)
        insert_new(self.db, JoinExperience, outbox, conn)
        conn.execute(update(JoinFeedback).where(JoinFeedback.event_id.in_(matched_ids))
                     .values(state=MATCHED))
        conn.execute(update(JoinSession).where(JoinSession.generation_id.in_(
            {row[2] for row in rows})).values(matched=True))

    def drain(self) -> None:
        """Produce every unproduced experience, await the acks, then mark them produced."""
        with self.db.connect() as conn:
            rows = conn.execute(select(JoinExperience.experience_id, JoinExperience.payload)
                                .where(JoinExperience.produced == False)  # noqa: E712
                                .limit(20_000)).all()
        if not rows:
            return
        topic = self.kafka.topics.experiences
        futures = [self.producer.send_raw(topic, eid, payload.encode()) for eid, payload in rows]
        offsets: dict[int, int] = {}
        for future in futures:
            meta = future.get(timeout=self.kafka.delivery_timeout_ms / 1000)
            offsets[meta.partition] = max(offsets.get(meta.partition, -1), meta.offset)
        with self.db.begin() as conn:
            mark_produced(conn, [eid for eid, _ in rows], offsets)
        self.stats.experiences += len(rows)

    def recover(self) -> None:
        """Mark outbox rows a killed predecessor produced but did not mark (topic tail scan)."""
        self._recovered = True
        with self.db.connect() as conn:
            pending = set(conn.execute(select(JoinExperience.experience_id)
                                       .where(JoinExperience.produced == False))  # noqa: E712
                          .scalars())
            starts = dict(conn.execute(select(JoinProgress.partition, JoinProgress.offset))
                          .tuples().all())
        if not pending:
            return
        seen = scan_keys(self.kafka, self.kafka.topics.experiences,
                         {p: o + 1 for p, o in starts.items()})
        found = sorted(pending & seen)
        if found:
            with self.db.begin() as conn:
                mark_produced(conn, found, {})
            log.warning("join: %d experiences were produced before a crash; not again",
                        len(found))

    def expire(self) -> None:
        """Send entries unmatched for `expire_after_s` to the DLQ, then forget them."""
        cutoff = self.clock() - self.settings.expire_after_s
        window = f"{self.settings.expire_after_s:.0f}s"
        topics = self.kafka.topics
        with self.db.connect() as conn:
            stale_feedback = conn.execute(
                select(JoinFeedback.event_id, JoinFeedback.generation_id, JoinFeedback.payload)
                .where(JoinFeedback.state == PENDING, JoinFeedback.first_seen < cutoff)).all()
            stale_sessions = conn.execute(
                select(JoinSession.generation_id, JoinSession.payload, JoinSession.matched)
                .where(JoinSession.first_seen < cutoff)).all()
        letters = [(topics.feedback, g, p, f"unmatched: no session for generation {g} "
                    f"within {window}") for _, g, p in stale_feedback]
        letters += [(topics.sessions, g, p, f"unmatched: no feedback for generation {g} "
                     f"within {window}") for g, p, matched in stale_sessions if not matched]
        futures = [self.producer.send(topics.dlq, g, DeadLetter.of(
            topic=topic, raw=p.encode(), key=g.encode(), reason=reason, consumer="join"))
            for topic, g, p, reason in letters]
        for future in futures:
            future.get(timeout=self.kafka.delivery_timeout_ms / 1000)
        with self.db.begin() as conn:
            for start in range(0, len(stale_feedback), 5000):
                ids = [e for e, _, _ in stale_feedback[start:start + 5000]]
                conn.execute(update(JoinFeedback).where(JoinFeedback.event_id.in_(ids))
                             .values(state=EXPIRED))
            for start in range(0, len(stale_sessions), 5000):
                ids = [g for g, _, _ in stale_sessions[start:start + 5000]]
                conn.execute(delete(JoinSession).where(JoinSession.generation_id.in_(ids)))
        self.stats.expired_feedback += len(stale_feedback)
        self.stats.expired_sessions += sum(1 for *_, m in stale_sessions if not m)

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()
        self.db.dispose()


def scan_keys(kafka: KafkaConfig, topic: str, starts: dict[int, int]) -> set[str]:
    """The keys of `topic` from `starts` (partition -> offset; else the beginning) to its end."""
    consumer = KafkaConsumer(bootstrap_servers=kafka.bootstrap, enable_auto_commit=False,
                             group_id=None, request_timeout_ms=kafka.request_timeout_ms)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic)
                                                        or ())]
        consumer.assign(tps)
        ends = consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, min(starts.get(tp.partition, 0), ends[tp]))
        keys: set[str] = set()
        deadline = time.monotonic() + 60
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: tail scan did not reach the end in 60s")
            for records in consumer.poll(timeout_ms=200).values():
                keys.update(r.key.decode() for r in records if r.key is not None)
        return keys
    finally:
        consumer.close()


def run_join(kafka: KafkaConfig, settings: JoinSettings, *, database_url: str,
             stop: threading.Event) -> JoinStats:
    """The `flywheel join` process body: run until `stop`, then print the counts as JSON."""
    ensure_topics(kafka)
    join = Join(kafka, settings, database_url=database_url)
    print(f"join: group {settings.group_id} on {kafka.bootstrap}", flush=True)
    stats = join.run(stop)
    print(json.dumps({"join": asdict(stats)}), flush=True)
    return stats
