"""The sessions x feedback join: rewarded experiences for the online trainer.

A consumer-group process (`flywheel join`) reads `sessions` and `feedback`, matches them by
generation_id in SQL (either may come first), and for every unique feedback event that meets
its session produces one `ExperienceReady` to `experiences`, keyed by an experience id derived
from the event id. Each poll runs: store records and matches (one SQL transaction of a few
set-based statements; the matches go to an outbox, one row per input partition) -> commit
the offsets -> send the experiences (from memory; after a restart, from SQL) without waiting:
their acks are taken during the next poll and marked by its transaction (`ingest.join_outbox`).
Recent sessions stay decoded in memory (`RecentSessions`), and each session's members of the
experience JSON are serialized once (`ingest.experience_json`), so an experience costs little
more than its produce.
A crash anywhere re-delivers records that the SQL ledger then ignores; experiences produced
but not marked are found on restart by scanning the topic's tail, so nothing counts twice.
Entries unmatched after `expire_after_s` go to `dlq` with the reason; undecodable records go
there with their raw bytes (EventConsumer).

Feedback may also be a verdict on a whole agent session (`session_id`, keyed by it): it
becomes one experience per turn of the session, once settled (`ingest.join_sessions`).

Several processes scale it out as one consumer group over one SQL state: every producer
partitions by CRC-32 of the key and both topics are keyed by generation_id, so a generation's
session and feedback share a partition number, which range assignment gives to one member.
Each member drains the outbox batches of the partitions it owns (after a rebalance, also those
a previous owner left), and its sweep matches the halves of a generation that two members stored
while the partition moved between them.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from kafka import TopicPartition
from sqlalchemy import Connection

from ingest.config import JoinSettings, KafkaConfig
from ingest.events import (
    DeadLetter,
    FeedbackReceived,
    GenerationLogged,
    encode,
    utcnow,
)
from ingest.experience_json import experience_id_of, joined_at_member, session_members
from ingest.join_outbox import Match, Outbox, Outgoing
from ingest.join_sessions import Judged, SessionVerdicts
from ingest.join_sessions_state import expire_verdicts, forget_turns, stale_verdicts, turn_row
from ingest.join_state import (
    MATCHED,
    PENDING,
    FeedbackRow,
    JoinFeedback,
    JoinSession,
    SessionRow,
    acked_offsets,
    add_to_outbox,
    awaited_sessions,
    claim_pending,
    claim_waiting,
    expire_feedback,
    forget_sessions,
    insert_new,
    last_seqs,
    mark_produced,
    open_state,
    outbox_row,
    pending_with_sessions,
    prune_outbox,
    sessions_matched,
    stale_pending,
    stale_sessions,
    stored_sessions,
    unproduced,
    writing,
)
from ingest.log import (
    Delivered,
    EventConsumer,
    EventProducer,
    ensure_topics,
    partition_for,
    scan_keys,
)
from ingest.rewards import reward_for
from ingest.sql_ids import existing_ids

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


class RecentSessions:
    """The last `capacity` sessions this join stored, decoded: feedback mostly follows its
    session closely, and then needs neither the SQL read nor a second decode of it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: dict[str, Match] = {}

    def get(self, generation_id: str) -> Match | None:
        return self._items.get(generation_id)

    def add(self, matches: dict[str, Match]) -> None:
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
        self.outbox = Outbox(self.producer, topics.experiences,
                             timeout_s=kafka.delivery_timeout_ms / 1000)
        self._next_sweep = 0.0
        self._loaded = False  # the outbox holds what a predecessor left (see `load_outbox`)
        self._seqs: dict[int, int] = {}  # the last outbox seq used, per owned source
        self._recent = RecentSessions(settings.session_cache)
        self._owned: set[int] = set()  # input partitions (sessions = feedback) assigned here
        self.verdicts = SessionVerdicts(self.db, settings, clock, lookup=self._stored_matches,
                                        store=self._store_batches)
        self.consumer.on_revoked.append(self._revoked)
        self.consumer.on_assigned.append(self._assigned)

    def _revoked(self, _partitions: set[TopicPartition]) -> None:
        """Before a rebalance moves partitions: the experiences in flight land and are marked,
        so their next owner's tail scan sees every record this member produced."""
        self.settle()

    def _assigned(self, partitions: set[TopicPartition]) -> None:
        """A rebalance gave this member `partitions`: it now owns their generations' outbox
        batches, including any a previous owner left unproduced (the step loads them)."""
        self._owned = {tp.partition for tp in partitions
                       if tp.topic == self.kafka.topics.feedback}
        self._loaded = False
        self.outbox.clear()
        self.verdicts.due = -math.inf  # verdicts a previous owner left pending

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
        """One poll: store and match (one transaction), commit the offsets, send the
        experiences; the acks of earlier ones are taken on the way (`Outbox`), and waited
        for when the poll brought nothing to overlap them with. Returns the records handled."""
        records = self.consumer.poll(
            timeout_ms=0 if self.outbox.in_flight else self.settings.poll_timeout_ms)
        if not self._loaded:  # after a poll that (re)joined the group: the previous
            self.load_outbox()  # owner's in-flight produce requests have landed
        try:
            if records:
                self.absorb(records)
                self.consumer.commit()  # what depends on the records is stored
            if self.clock() >= self._next_sweep:
                self.sweep()
            elif self.clock() >= self.verdicts.due:
                self.expand_verdicts()
            self.outbox.send()
            self.outbox.settle(block=not records)
        except BaseException:
            self.outbox.clear()
            self._loaded = False  # reload from SQL: nothing stored is forgotten
            raise
        if not records:
            self._write_marks()
        self.stats.experiences = self.outbox.produced
        self.stats.dead_letters = self.consumer.dead_letters
        return len(records)

    def sweep(self) -> None:
        """Every `sweep_every_s`: match what two members left pending, expand the settled
        session verdicts, delete the produced outbox batches, expire what stayed unmatched."""
        self.rematch()
        self.expand_verdicts()
        with writing(self.db) as conn:
            prune_outbox(conn, self._owned)
        self.expire()
        self._next_sweep = self.clock() + self.settings.sweep_every_s

    def settle(self) -> None:
        """Wait for the experiences in flight, then mark them produced."""
        self.outbox.settle(block=True)
        self._write_marks()
        self.stats.experiences = self.outbox.produced

    def _write_marks(self, conn: Connection | None = None) -> None:
        """Mark what the broker acked as produced: in `conn`'s transaction, else in one of
        its own (only if there is something to mark)."""
        marks = self.outbox.take_marks()
        if not marks:
            return
        if conn is not None:
            mark_produced(conn, marks.seqs, marks.offsets)
            return
        with writing(self.db) as own:
            mark_produced(own, marks.seqs, marks.offsets)

    def absorb(self, records: list[Delivered[Any]]) -> None:
        """Store sessions and new feedback, and queue an experience per new match: new
        feedback meets sessions of this poll or stored ones; sessions of this poll meet
        stored pending feedback. Session verdicts are stored, to be expanded once settled.
        One transaction, a few set-based statements."""
        now = self.clock()
        sessions, feedback, verdicts, received = _split(records)
        with writing(self.db) as conn:
            known = existing_ids(conn, JoinFeedback.event_id, feedback)
            # feedback about one generation: its `key` is the generation_id
            fresh = [d.event for e, d in feedback.items() if e not in known]
            matches = {g: Match(d.event, session_members(d.event))
                       for g, d in sessions.items()}
            stored = self._stored_matches(conn, {f.key for f in fresh} - set(sessions))
            matches.update(stored)
            waiting = claim_waiting(conn, set(sessions))
            pairs = [(f, matches[f.key]) for f in fresh if f.key in matches]
            pairs += [(f, matches[f.key]) for f, _ in waiting]
            matched_generations = {f.key for f, _ in pairs}
            insert_new(conn, JoinSession, [
                SessionRow(g, d.raw.decode(), now, g in matched_generations)
                for g, d in sessions.items()])
            # a matched event's payload is never read again: only pending ones keep it
            insert_new(conn, JoinFeedback, [
                FeedbackRow(f.event_id, f.key, "", now, MATCHED) if f.key in matches else
                FeedbackRow(f.event_id, f.key, feedback[f.event_id].raw.decode(), now,
                            PENDING) for f in fresh])
            new_verdicts = self.verdicts.absorb(
                conn, [d.event for d in sessions.values()], list(verdicts.values()), now)
            newly = [g for g in matched_generations if not matches[g].matched]
            sessions_matched(conn, set(newly) - set(sessions))
            for g in newly:
                matches[g].matched = True
            self.stats.sessions += len(sessions)
            self.stats.feedback += len(fresh) + new_verdicts
            self.stats.verdicts += new_verdicts
            self.stats.duplicates += received - len(fresh) - new_verdicts
            raws = {e: d.raw for e, d in feedback.items()}
            raws.update((f.event_id, raw.encode()) for f, raw in waiting)
            self._queue(conn, pairs, raws)
            self._write_marks(conn)
        self._recent.add({g: matches[g] for g in sessions})

    def _stored_matches(self, conn: Connection, generation_ids: set[str]) -> dict[str, Match]:
        """Stored sessions among `generation_ids`: recent ones from memory, others from SQL."""
        found = {g: m for g in generation_ids if (m := self._recent.get(g)) is not None}
        loaded = stored_sessions(conn, generation_ids - set(found))
        fetched = {g: Match(s, session_members(s), matched)
                   for g, (s, matched) in loaded.items()}
        self._recent.add(fetched)
        return {**found, **fetched}

    def _queue(self, conn: Connection, pairs: list[tuple[FeedbackReceived, Match]],
               raws: dict[str, bytes] | None = None) -> None:
        """Store the matches of `pairs` (feedback about one generation) in the outbox, one
        batch per source (this transaction), and queue their experiences in memory. `raws`:
        the feedback JSON as received, by event id, where the caller has it."""
        rewards = self.settings.rewards
        by_source: dict[int, list[Judged]] = {}
        sources: dict[str, int] = {}  # per generation: sessions have many feedback events
        for f, m in pairs:
            generation_id = m.session.generation_id
            source = sources.get(generation_id)
            if source is None:
                source = sources[generation_id] = self._partition_of(generation_id)
            by_source.setdefault(source, []).append((f, m, reward_for(f, rewards), None))
        self._store_batches(conn, by_source, raws or {})

    def _store_batches(self, conn: Connection, by_source: dict[int, list[Judged]],
                       raws: dict[str, bytes]) -> None:
        """One outbox batch per source of `by_source` (and the turns of a session verdict's
        experiences), in this transaction; their experiences queued in memory."""
        now = utcnow()
        joined, stamp = joined_at_member(now), now.timestamp()
        stored, turn_rows, outgoing = [], [], []
        for source, batch in by_source.items():
            if source not in self._seqs:  # a record outside this member's partitions
                self._seqs.update(last_seqs(conn, [source]))
            seq = self._seqs[source] = self._seqs[source] + 1
            feedback, batch_rewards, turns = [], [], []
            for f, m, reward, turn in batch:
                raw, generation_id = raws.get(f.event_id), m.session.generation_id
                feedback.append(raw if raw is not None else encode(f))
                batch_rewards.append(reward)
                turns.append(None if turn is None else (generation_id, turn))
                outgoing.append(Outgoing(source, seq, experience_id_of(f, generation_id),
                                         (m, f, reward, joined), turn=turn))
            stored.append(outbox_row(source, seq, feedback, batch_rewards, stamp))
            if (row := turn_row(source, seq, turns)) is not None:
                turn_rows.append(row)
        add_to_outbox(conn, stored, turn_rows)
        self.outbox.add(outgoing)

    def load_outbox(self) -> None:
        """Take on the outbox batches of this member's partitions that are not marked
        produced: those a killed predecessor (or this member, before an error) left. Some of
        their experiences it may have produced without marking: a scan of the experiences
        topic from the last offsets acked for those partitions finds them, and they are
        marked, not produced again. Loaded only once the scan has told them apart: a
        failed scan leaves the outbox empty and the next step loads again."""
        owned = sorted(self._owned)
        with self.db.connect() as conn:
            self._seqs = last_seqs(conn, owned)
            matches: dict[str, Match] = {}
            rows = []
            for x in unproduced(conn, owned):
                match = matches.get(x.session.generation_id)
                if match is None:
                    match = matches[x.session.generation_id] = Match(
                        x.session, session_members(x.session), matched=True)
                rows.append(Outgoing(
                    x.source, x.seq, experience_id_of(x.feedback, x.session.generation_id),
                    (match, x.feedback, x.reward,
                     joined_at_member(datetime.fromtimestamp(x.joined_at, UTC))), turn=x.turn))
            progress = acked_offsets(conn, owned)
        if rows:
            self._skip_produced(rows, progress)
        self.outbox.add(rows)
        self._loaded = True

    def _skip_produced(self, rows: list[Outgoing], progress: list[tuple[int, int, int]]
                       ) -> None:
        """Mark `produce=False` on the rows found on the experiences topic: a source's
        unmarked rows were produced after its marked ones, so the scan starts at the earliest
        acked offset among the sources with rows pending (0 where one has none yet)."""
        sources = {row.source for row in rows}
        acked: dict[int, dict[int, int]] = {}
        for source, partition, offset in progress:
            acked.setdefault(partition, {})[source] = offset
        count = self.producer.partitions(self.kafka.topics.experiences)
        starts = {q: min(acked.get(q, {}).get(p, -1) + 1 for p in sources) for q in range(count)}
        seen = scan_keys(self.kafka, self.kafka.topics.experiences, starts,
                         {row.experience_id for row in rows})
        for row in rows:
            row.produce = row.experience_id not in seen
        if found := sum(not row.produce for row in rows):
            log.warning("join: %d experiences were produced before a crash; not again", found)

    def rematch(self) -> None:
        """Match pending feedback whose session is stored after all. Sessions and feedback are
        co-partitioned (`ingest.log.partition_for`), so one member sees both halves of a
        generation; only while a partition moves between members can each store its half
        before seeing the other's, and this sweep (by the partition's owner) closes that gap."""
        with writing(self.db) as conn:
            found = pending_with_sessions(
                conn, lambda generation_id: self._partition_of(generation_id) in self._owned)
            if not found:
                return
            claimed = claim_pending(conn, [f.event_id for f, _ in found])
            pairs = [(f, Match(s, session_members(s), matched=True)) for f, s in found
                     if f.event_id in claimed]
            sessions_matched(conn, {m.session.generation_id for _, m in pairs})
            self._queue(conn, pairs)
        self.stats.rematched += len(pairs)
        if pairs:
            log.info("join: %d pending feedback events met sessions stored meanwhile",
                     len(pairs))

    def expand_verdicts(self) -> None:
        """Expand the settled session verdicts of this member's partitions into experiences
        (`SessionVerdicts.expand`)."""
        verdicts, _ = self.verdicts.expand(self._owned)
        self.stats.verdicts_expanded += verdicts

    def expire(self) -> None:
        """Send entries unmatched for `expire_after_s` to the DLQ, then forget them."""
        cutoff = self.clock() - self.settings.expire_after_s
        window = f"{self.settings.expire_after_s:.0f}s"
        topics = self.kafka.topics
        with self.db.connect() as conn:
            stale_feedback = stale_pending(conn, cutoff)
            verdicts = stale_verdicts(conn, cutoff)
            old_sessions = stale_sessions(conn, cutoff)
            # a session stays while an experience of it waits to be produced (and rebuilt)
            waiting = awaited_sessions(conn) if old_sessions else set()
            old_sessions = [row for row in old_sessions if row[0] not in waiting]
        letters = [(topics.feedback, g, p, f"unmatched: no session for generation {g} "
                    f"within {window}") for _, g, p in stale_feedback]
        letters += [(topics.feedback, s, p, f"unmatched: no generation of session {s} "
                     f"within {window}") for _, s, p in verdicts]
        letters += [(topics.sessions, g, p, f"unmatched: no feedback for generation {g} "
                     f"within {window}") for g, p, matched in old_sessions if not matched]
        futures = [self.producer.send(topics.dlq, g, DeadLetter.of(
            topic=topic, raw=p.encode(), key=g.encode(), reason=reason, consumer="join"))
            for topic, g, p, reason in letters]
        for future in futures:
            future.get(timeout=self.kafka.delivery_timeout_ms / 1000)
        with writing(self.db) as conn:
            expire_feedback(conn, [e for e, _, _ in stale_feedback])
            expire_verdicts(conn, [e for e, _, _ in verdicts])
            forget_sessions(conn, [g for g, _, _ in old_sessions])
            forget_turns(conn, [g for g, _, _ in old_sessions])
        self._recent.forget(g for g, _, _ in old_sessions)
        self.stats.expired_feedback += len(stale_feedback)
        self.stats.expired_verdicts += len(verdicts)
        self.stats.expired_sessions += sum(1 for *_, m in old_sessions if not m)

    def close(self) -> None:
        """Let the experiences in flight land and mark them, then close the clients."""
        try:
            self.settle()
        finally:
            self.consumer.close()
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


# Python's (700, 10, 10) ran the cyclic collector often enough that scanning the join's
# long-lived heap (recent sessions, decoded) took about a third of its CPU per event
_GC_THRESHOLDS = (50_000, 20, 100)


def relax_gc() -> None:
    """Fewer cyclic-GC passes in a join process: it allocates a few container objects per
    record (decoded events, rows, tuples), nearly all freed by reference counting, while a
    full pass scans every cached session. `bench/join_member.py --default-gc` measures the
    difference. Process-wide: called by the process that runs the join, not by `Join`."""
    gc.set_threshold(*_GC_THRESHOLDS)


def run_join(kafka: KafkaConfig, settings: JoinSettings, *, database_url: str,
             stop: threading.Event) -> JoinStats:
    """The `flywheel join` process body: run until `stop`, then print the counts as JSON."""
    ensure_topics(kafka)
    join = Join(kafka, settings, database_url=database_url)
    print(f"join: group {settings.group_id} on {kafka.bootstrap}", flush=True)
    stats = join.run(stop)
    print(json.dumps({"join": asdict(stats)}), flush=True)
    return stats
