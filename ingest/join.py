"""The sessions x feedback join: rewarded experiences for the online trainer.

A consumer-group process (`flywheel join`) reads `sessions` and `feedback`, matches them by
generation_id in SQL (either may come first), and for every unique feedback event that meets
its session produces one `ExperienceReady` to `experiences`, keyed by an experience id derived
from the event id. Each poll runs: store records and matches (one SQL transaction of a few
set-based statements, the experiences go to an outbox) -> produce the outbox (from memory; after
a restart, from SQL), await acks, mark it -> commit offsets. Recent sessions stay decoded in
memory (`RecentSessions`), and each session's members of the experience JSON are serialized
once (`session_members`), so an experience costs little more than its produce.
A crash anywhere re-delivers records that the SQL ledger then ignores; outbox rows produced
but not marked are found on restart by scanning the topic's tail, so nothing counts twice.
Entries unmatched after `expire_after_s` go to `dlq` with the reason; undecodable records go
there with their raw bytes (EventConsumer).

Several processes scale it out as one consumer group over one SQL state: every producer
partitions by CRC-32 of the key and both topics are keyed by generation_id, so a generation's
session and feedback share a partition number, which range assignment gives to one member.
Each member drains the outbox rows of the partitions it owns (after a rebalance, also those a
previous owner left), and its sweep matches the halves of a generation that two members stored
while the partition moved between them.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from kafka import KafkaConsumer, TopicPartition
from pydantic import TypeAdapter
from sqlalchemy import Connection, delete, select, update

from ingest.config import JoinSettings, KafkaConfig
from ingest.events import (
    SCHEMA_VERSION,
    DeadLetter,
    ExperienceReady,
    FeedbackReceived,
    GenerationLogged,
    encode,
    experience_id_for,
    utcnow,
)
from ingest.join_state import (
    EXPIRED,
    MATCHED,
    PENDING,
    JoinExperience,
    JoinFeedback,
    JoinProgress,
    JoinSession,
    claim_pending,
    insert_new,
    mark_produced,
    open_state,
    pending_feedback,
    pending_with_sessions,
    set_matched,
    stored_sessions,
)
from ingest.log import Delivered, EventConsumer, EventProducer, ensure_topics, partition_for
from ingest.rewards import reward_for
from ingest.sql_ids import existing_ids

log = logging.getLogger(__name__)
_PRODUCE_CHUNK = 20_000  # experiences per produce-and-mark round


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


_SESSION_PART = {"model_version", "model_sha256", "prompt_token_ids", "completion_token_ids",
                 "logprobs", "routed_experts", "sampling", "finish_reason"}
_TIME = TypeAdapter(datetime)


def session_members(session: GenerationLogged) -> bytes:
    """The session's members of every ExperienceReady it yields, as JSON object members
    (`"model_version":…,"generated_at":…`), serialized once per session."""
    members = session.model_dump_json(include=_SESSION_PART)[1:-1]
    return members.encode() + b',"generated_at":' + _TIME.dump_json(session.created_at)


def joined_at_member(joined_at: datetime) -> bytes:
    return b',"joined_at":' + _TIME.dump_json(joined_at)


def experience_json(session: GenerationLogged, members: bytes, feedback: FeedbackReceived,
                    reward: float, joined: bytes) -> bytes:
    """`encode(build_experience(session, feedback, reward))` up to member order, from the
    session's pre-serialized members and `joined_at_member(...)`: only the feedback's few
    fields are serialized here. SPLICED_FIELDS must stay all of ExperienceReady's fields."""
    head = {"event": "ExperienceReady", "schema_version": SCHEMA_VERSION,
            "experience_id": experience_id_for(feedback.event_id),
            "generation_id": session.generation_id, "feedback_event_ids": [feedback.event_id],
            "feedback_kind": feedback.kind, "feedback_value": feedback.value, "reward": reward}
    try:
        text = json.dumps(head, separators=(",", ":"), allow_nan=False)
    except ValueError:  # inf/nan: pydantic's own rules for them
        return encode(build_experience(session, feedback, reward))
    return text[:-1].encode() + b"," + members + joined + b"}"


SPLICED_FIELDS = {"event", "schema_version", "experience_id", "generation_id",
                  "feedback_event_ids", "feedback_kind", "feedback_value", "reward",
                  "generated_at", "joined_at", *_SESSION_PART}


@dataclass
class _Match:
    """A session as the join uses it: decoded once, its experience members serialized once."""

    session: GenerationLogged
    members: bytes


class RecentSessions:
    """The last `capacity` sessions this join stored, decoded: feedback mostly follows its
    session closely, and then needs neither the SQL read nor a second decode of it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: dict[str, _Match] = {}

    def get(self, generation_id: str) -> _Match | None:
        return self._items.get(generation_id)

    def add(self, matches: dict[str, _Match]) -> None:
        items = self._items
        items.update(matches)
        for _ in range(len(items) - self.capacity):
            del items[next(iter(items))]

    def forget(self, generation_ids: Iterable[str]) -> None:
        for generation_id in generation_ids:
            self._items.pop(generation_id, None)


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
        self._outbox_loaded = False  # the first drain reads what a predecessor left unproduced
        # stored by this process, not produced yet: (experience id, input partition, JSON)
        self._outbox: list[tuple[str, int, bytes]] = []
        self._recent = RecentSessions(settings.session_cache)
        self._owned: set[int] = set()  # input partitions (sessions = feedback) assigned here
        self.consumer.on_assigned.append(self._assigned)

    def _assigned(self, partitions: set[TopicPartition]) -> None:
        """A rebalance gave this member `partitions`: it now owns their generations' outbox
        rows, including any a previous owner left unproduced: the step recovers those it did
        produce, and the next drain reads the rest."""
        self._owned = {tp.partition for tp in partitions
                       if tp.topic == self.kafka.topics.feedback}
        self._recovered = self._outbox_loaded = False

    def _partition_of(self, generation_id: str) -> int:
        """The input partition of a generation (sessions and feedback are co-partitioned)."""
        return partition_for(generation_id.encode(),
                             self.producer.partitions(self.kafka.topics.feedback))

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
        if not self._recovered:  # after a poll that (re)joined the group: the previous
            self.recover()        # owner's in-flight produce requests have landed
        if records:
            self.absorb(records)
        self.drain()
        if records:
            self.consumer.commit()
        if self.clock() >= self._next_sweep:
            self.rematch()
            self.expire()
            self._next_sweep = self.clock() + self.settings.sweep_every_s
        self.stats.dead_letters = self.consumer.dead_letters
        return len(records)

    def absorb(self, records: list[Delivered[Any]]) -> None:
        """Store sessions and new feedback, and queue an experience per new match: new
        feedback meets sessions of this poll or stored ones; sessions of this poll meet
        stored pending feedback. One transaction, a few set-based statements."""
        now = self.clock()
        sessions = {d.event.generation_id: d for d in records
                    if isinstance(d.event, GenerationLogged)}
        feedback = {d.event.event_id: d for d in records
                    if isinstance(d.event, FeedbackReceived)}
        with self.db.begin() as conn:
            known = existing_ids(conn, JoinFeedback.event_id, feedback)
            fresh = [d.event for e, d in feedback.items() if e not in known]
            self.stats.duplicates += sum(isinstance(d.event, FeedbackReceived)
                                         for d in records) - len(fresh)
            matches = {g: _Match(d.event, session_members(d.event))
                       for g, d in sessions.items()}
            stored = self._stored_matches(conn, {f.generation_id for f in fresh} - set(sessions))
            matches.update(stored)
            waiting = pending_feedback(conn, set(sessions))
            pairs = [(f, matches[f.generation_id]) for f in fresh
                     if f.generation_id in matches]
            pairs += [(f, matches[f.generation_id]) for f in waiting]
            matched_generations = {f.generation_id for f, _ in pairs}
            insert_new(self.db, JoinSession, [
                {"generation_id": g, "payload": d.raw.decode(), "first_seen": now,
                 "matched": g in matched_generations} for g, d in sessions.items()], conn)
            insert_new(self.db, JoinFeedback, [
                {"event_id": f.event_id, "generation_id": f.generation_id,
                 # a matched event's payload is never read again: only pending ones keep it
                 "payload": "" if f.generation_id in matches
                 else feedback[f.event_id].raw.decode(),
                 "first_seen": now,
                 "state": MATCHED if f.generation_id in matches else PENDING}
                for f in fresh], conn)
            set_matched(conn, [f.event_id for f in waiting], set(stored) & matched_generations)
            self.stats.sessions += len(sessions)
            self.stats.feedback += len(fresh)
            self._queue(conn, pairs)
        self._recent.add({g: matches[g] for g in sessions})

    def _stored_matches(self, conn: Connection, generation_ids: set[str]) -> dict[str, _Match]:
        """Stored sessions among `generation_ids`: recent ones from memory, others from SQL."""
        found = {g: m for g in generation_ids if (m := self._recent.get(g)) is not None}
        loaded = stored_sessions(conn, generation_ids - set(found))
        fetched = {g: _Match(s, session_members(s)) for g, s in loaded.items()}
        self._recent.add(fetched)
        return {**found, **fetched}

    def _queue(self, conn: Connection, pairs: list[tuple[FeedbackReceived, _Match]]) -> None:
        """Build the experiences of `pairs` into the outbox (this transaction) and memory."""
        rewards, joined = self.settings.rewards, joined_at_member(utcnow())
        rows = [(experience_id_for(f.event_id), f.event_id, m.session.generation_id,
                 experience_json(m.session, m.members, f, reward_for(f, rewards), joined))
                for f, m in pairs]
        sources = [self._partition_of(g) for _, _, g, _ in rows]
        insert_new(self.db, JoinExperience, [
            {"experience_id": x, "event_id": e, "generation_id": g, "payload": p.decode(),
             "partition": source, "produced": False}
            for (x, e, g, p), source in zip(rows, sources, strict=True)], conn)
        self._outbox += [(x, source, p) for (x, _, _, p), source in zip(rows, sources,
                                                                         strict=True)]

    def drain(self) -> None:
        """Produce every unproduced experience, await the acks, then mark them produced."""
        if not self._outbox_loaded:  # what a predecessor (or this one, so far) left behind
            with self.db.connect() as conn:
                self._outbox = [(x, source, p.encode()) for x, source, p in conn.execute(
                    select(JoinExperience.experience_id, JoinExperience.partition,
                           JoinExperience.payload)
                    .where(JoinExperience.produced == False,  # noqa: E712
                           JoinExperience.partition.in_(sorted(self._owned))))]  # type: ignore[attr-defined]
            self._outbox_loaded = True
        rows, self._outbox = self._outbox, []
        try:
            for start in range(0, len(rows), _PRODUCE_CHUNK):
                self._produce(rows[start:start + _PRODUCE_CHUNK])
        except BaseException:
            self._outbox_loaded = False  # re-read from SQL: nothing stored is forgotten
            raise

    def _produce(self, rows: list[tuple[str, int, bytes]]) -> None:
        producer, topic = self.producer, self.kafka.topics.experiences
        partitions = producer.partitions(topic)
        records = []
        for experience_id, _, payload in rows:
            key = experience_id.encode()
            records.append((partition_for(key, partitions), key, payload))
        futures = producer.send_many(topic, records)
        last = {(source, partition): future for (_, source, _), (partition, _, _), future
                in zip(rows, records, futures, strict=True)}
        timeout_s = self.kafka.delivery_timeout_ms / 1000
        producer.flush(timeout_s)
        for future in futures:
            if not future.is_done or future.failed():
                future.get(timeout=timeout_s)  # raises the broker's error
        offsets = {p: f.get(timeout=timeout_s).offset for p, f in last.items()}
        with self.db.begin() as conn:
            mark_produced(conn, [x for x, _, _ in rows], offsets)
        self.stats.experiences += len(rows)

    def recover(self) -> None:
        """Mark the outbox rows of this member's partitions that a killed predecessor produced
        but did not mark: scan the experiences topic from the last offsets acked for them."""
        self._recovered = True
        owned = sorted(self._owned)
        with self.db.connect() as conn:
            pending = dict(conn.execute(
                select(JoinExperience.experience_id, JoinExperience.partition)
                .where(JoinExperience.produced == False,  # noqa: E712
                       JoinExperience.partition.in_(owned))).tuples().all())  # type: ignore[attr-defined]
            progress = conn.execute(select(JoinProgress.source, JoinProgress.partition,
                                           JoinProgress.offset)
                                    .where(JoinProgress.source.in_(owned))).tuples().all()  # type: ignore[attr-defined]
        if not pending:
            return
        # a source's unmarked rows were produced after its marked ones: from the earliest
        # acked offset among the sources with rows pending (0 where one has none yet)
        sources = set(pending.values())
        acked: dict[int, dict[int, int]] = {}
        for source, partition, offset in progress:
            acked.setdefault(partition, {})[source] = offset
        count = self.producer.partitions(self.kafka.topics.experiences)
        starts = {q: min(acked.get(q, {}).get(p, -1) + 1 for p in sources) for q in range(count)}
        seen = scan_keys(self.kafka, self.kafka.topics.experiences, starts, set(pending))
        found = sorted(pending.keys() & seen)
        if found:
            with self.db.begin() as conn:
                mark_produced(conn, found, {})
            log.warning("join: %d experiences were produced before a crash; not again",
                        len(found))

    def rematch(self) -> None:
        """Match pending feedback whose session is stored after all. Sessions and feedback are
        co-partitioned (`ingest.log.partition_for`), so one member sees both halves of a
        generation; only while a partition moves between members can each store its half
        before seeing the other's, and this sweep (by the partition's owner) closes that gap."""
        with self.db.begin() as conn:
            found = pending_with_sessions(
                conn, lambda generation_id: self._partition_of(generation_id) in self._owned)
            if not found:
                return
            claimed = claim_pending(conn, [f.event_id for f, _ in found])
            pairs = [(f, _Match(s, session_members(s))) for f, s in found
                     if f.event_id in claimed]
            set_matched(conn, [], {m.session.generation_id for _, m in pairs})
            self._queue(conn, pairs)
        self.stats.rematched += len(pairs)
        if pairs:
            log.info("join: %d pending feedback events met sessions stored meanwhile",
                     len(pairs))
            self.drain()

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
        self._recent.forget(g for g, _, _ in stale_sessions)
        self.stats.expired_feedback += len(stale_feedback)
        self.stats.expired_sessions += sum(1 for *_, m in stale_sessions if not m)

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()
        self.db.dispose()


def scan_keys(kafka: KafkaConfig, topic: str, starts: dict[int, int],
              wanted: set[str] | None = None) -> set[str]:
    """The keys of `topic` from `starts` (partition -> offset; else the beginning) to its end,
    or until every key of `wanted` is seen.

    A poll takes every fetched record (Tansu's end offset is the last batch's first offset
    + 1, so a poll that stopped partway through the last batch would look like the end)."""
    consumer = KafkaConsumer(bootstrap_servers=kafka.bootstrap, enable_auto_commit=False,
                             group_id=None, request_timeout_ms=kafka.request_timeout_ms,
                             max_poll_records=1_000_000)
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
            if wanted is not None and wanted <= keys:
                break
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
