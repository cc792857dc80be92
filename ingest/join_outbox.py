"""The join's outbox in memory: matched experiences between the SQL outbox and Kafka.

Each poll's matches are stored in the outbox table (`ingest.join_state`) by the poll's own
transaction, then `add`ed here. `send` produces them without waiting for the broker, in
rounds of whole outbox batches; `settle` takes the rounds the broker acked, oldest first, and
folds them into `Marks` (per input partition the highest outbox seq produced, per experiences
partition the highest offset), which the join writes with its next transaction. So the next
poll is read, decoded and stored while this one's experiences are in flight, and the join
commits its Kafka offsets as soon as the transaction that stored the records commits: after a
crash the unmarked batches are still in SQL (`Join.load_outbox`), and a scan of the
experiences topic's tail tells which of them reached it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ingest.events import FeedbackReceived, GenerationLogged
from ingest.experience_json import Turn, experience_json
from ingest.log import EventProducer, Queued, partition_for

PRODUCE_CHUNK = 20_000  # experiences per round, about (a round ends with an outbox batch)
# rounds sent and not acked; `send` waits for the oldest past this. The bound on what the join
# holds for the broker: kafka-python's accumulator has no memory limit of its own
MAX_IN_FLIGHT = 2


@dataclass
class Match:
    """A session as the join uses it: decoded once, its experience members serialized once,
    and whether its stored row is marked matched already (so it is written once)."""

    session: GenerationLogged
    members: bytes
    matched: bool = False


@dataclass
class Outgoing:
    """An experience of outbox batch (`source`, `seq`). Its JSON is built from `parts`
    (match, feedback, reward, joined_at member) and, for a session verdict's, `turn` when it
    is sent, outside the SQL transaction that stored the batch. `produce` is False for one a
    predecessor produced (found in the topic's tail): it is not sent again, only marked with
    the rest."""

    source: int
    seq: int
    experience_id: str
    parts: tuple[Match, FeedbackReceived, float, bytes]
    produce: bool = True
    turn: Turn | None = None

    def payload(self) -> bytes:
        match, feedback, reward, joined = self.parts
        return experience_json(match.session, match.members, feedback, reward, joined,
                               self.turn)


@dataclass
class Marks:
    """What acked rounds let the join write (`join_state.mark_produced`): per input partition
    the highest outbox seq produced, per (input partition, experiences partition) the highest
    offset acked."""

    seqs: dict[int, int] = field(default_factory=dict)
    offsets: dict[tuple[int, int], int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.seqs)


@dataclass
class _Round:
    """Experiences sent together: whole outbox batches, by seq within each source."""

    queued: list[Queued]  # where each record sent went
    seqs: dict[int, int]  # per source, its highest seq here
    last: dict[tuple[int, int], Queued]  # per (source, experiences partition), its last record


class Outbox:
    """Experiences queued (stored in SQL, not sent) and in flight (sent, not acked)."""

    def __init__(self, producer: EventProducer, topic: str, *, timeout_s: float,
                 chunk: int = PRODUCE_CHUNK, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self.producer, self.topic, self.timeout_s = producer, topic, timeout_s
        self.chunk, self.max_in_flight = chunk, max_in_flight
        self.queued: list[Outgoing] = []
        self._in_flight: deque[_Round] = deque()
        self.marks = Marks()  # settled, not written yet
        self.produced = 0  # experiences acked since start

    @property
    def in_flight(self) -> bool:
        return bool(self._in_flight)

    def add(self, rows: list[Outgoing]) -> None:
        self.queued += rows

    def send(self) -> None:
        """Produce everything queued, in rounds that end with a whole outbox batch (a batch is
        marked as one); past `max_in_flight` rounds, wait for the oldest first."""
        rows, self.queued = self.queued, []
        start = 0
        while start < len(rows):
            end = min(start + self.chunk, len(rows))
            while end < len(rows) and (rows[end].source, rows[end].seq) == (
                    rows[end - 1].source, rows[end - 1].seq):
                end += 1
            if len(self._in_flight) >= self.max_in_flight:
                self._settle_oldest()
            self._send(rows[start:end])
            start = end

    def _send(self, rows: list[Outgoing]) -> None:
        partitions = self.producer.partitions(self.topic)
        sending = [row for row in rows if row.produce]
        records = []
        for row in sending:
            key = row.experience_id.encode()
            records.append((partition_for(key, partitions), key, row.payload()))
        queued = self.producer.send_many(self.topic, records)
        self._in_flight.append(_Round(
            queued, {row.source: row.seq for row in rows},
            {(row.source, partition): q for row, (partition, _, _), q
             in zip(sending, records, queued, strict=True)}))

    def settle(self, *, block: bool) -> None:
        """Fold the acked rounds, oldest first, into `marks`; with `block`, wait for every
        round in flight. Raises the broker's error for a round that failed
        (KafkaTimeoutError past `timeout_s`)."""
        while self._in_flight and (block or EventProducer.acked(self._in_flight[0].queued)):
            self._settle_oldest()

    def _settle_oldest(self) -> None:
        round_ = self._in_flight[0]
        EventProducer.wait(round_.queued, self.timeout_s)
        self._in_flight.popleft()
        self.marks.seqs.update(round_.seqs)
        self.marks.offsets.update((key, EventProducer.offset(q)) for key, q in round_.last.items())
        self.produced += len(round_.queued)

    def take_marks(self) -> Marks:
        marks, self.marks = self.marks, Marks()
        return marks

    def clear(self) -> None:
        """Forget everything (after a rebalance or an error: the SQL outbox holds it)."""
        self.queued, self._in_flight, self.marks = [], deque(), Marks()
