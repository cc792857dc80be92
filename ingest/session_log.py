"""The session log: `GenerationLogged` to Kafka off the request path, never losing a record.

`submit()` only puts the event on a bounded in-memory queue (it never blocks; when the queue is
full the record goes straight to the spool). One sender thread drains the queue in batches
(once a record is there it lingers `linger_s`, 0.1 s by default, for more: one produce request
per record cost the serving process and the broker ~6% of a request's p50 at c=8 on 2 cores,
bench/serving.py's `logging_overhead_p50`, against 0-2% batched), produces them (acks=all)
and waits for the acks. A record that is not acknowledged within the
producer's delivery timeout, or that cannot even be sent (broker unreachable), is appended to a
local append-only spool (`ingest.spool`); while the spool holds anything, new records go behind
it and the sender replays it in order, oldest first, until the broker answers again. Delivery
is at-least-once: a retry may repeat a record (keyed by generation_id, consumers dedupe), never
lose one. Records still queued at `close()` are spooled and replayed by the next process.

    log = SessionLog(kafka, Spool(data_dir / "spool" / "sessions.jsonl")).start()
    log.submit(event)            # from the request path
    log.flush(timeout_s=10)      # tests and shutdown: wait until Kafka has everything
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from kafka.errors import KafkaError

from ingest.config import KafkaConfig
from ingest.events import GenerationLogged, encode
from ingest.log import EventProducer
from ingest.spool import Spool, SpoolRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionLogStats:
    queued: int  # in memory: waiting or in flight
    spool_records: int
    spool_bytes: int
    sent: int  # acknowledged by Kafka, first try
    spilled: int  # written to the spool
    replayed: int  # acknowledged by Kafka from the spool


class SessionLog:
    """Bounded queue -> Kafka, spilling to `spool` while Kafka is unreachable (module doc)."""

    def __init__(self, config: KafkaConfig, spool: Spool, *, max_queue: int = 10_000,
                 batch_size: int = 256, retry_s: float = 0.5, linger_s: float = 0.1) -> None:
        self.config = config
        self.topic = config.topics.sessions
        self.spool = spool
        self._queue: queue.Queue[GenerationLogged] = queue.Queue(maxsize=max_queue)
        self._batch_size = batch_size
        self._retry_s = retry_s
        self._linger_s = linger_s
        self._producer: EventProducer | None = None
        self._stop = threading.Event()
        self._counts = threading.Lock()
        self._inflight = 0
        self._submitted = self._sent = self._spilled = self._replayed = 0
        self._thread = threading.Thread(target=self._run, name="session-log", daemon=True)

    def start(self) -> SessionLog:
        self._thread.start()
        return self

    # ---- request path -------------------------------------------------------------------
    def submit(self, event: GenerationLogged) -> None:
        """Hand one generation to the log; never blocks on Kafka."""
        with self._counts:
            self._submitted += 1
        try:
            self._queue.put_nowait(event)
        except queue.Full:  # overloaded and Kafka slow: disk keeps it
            self._spill([self._record(event)])

    def stats(self) -> SessionLogStats:
        return SessionLogStats(queued=self._queue.qsize() + self._inflight,
                               spool_records=self.spool.pending_records,
                               spool_bytes=self.spool.pending_bytes, sent=self._sent,
                               spilled=self._spilled, replayed=self._replayed)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every submitted record is acknowledged by Kafka; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            # every record is counted once as sent or spilled; spilled ones leave the spool
            # only once acknowledged
            if self._sent + self._spilled >= self._submitted and not self.spool.pending_records:
                return True
            time.sleep(0.02)
        return False

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the sender; whatever Kafka has not acknowledged stays in the spool."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=max(timeout_s, self.config.delivery_timeout_ms / 1000 + 2))
        while records := self._drain(0):
            self._spill(records)
        if self._producer is not None:
            self._producer.abandon()  # everything it held was acknowledged or spooled
        self.spool.close()

    # ---- sender thread ------------------------------------------------------------------
    def _record(self, event: GenerationLogged) -> SpoolRecord:
        return SpoolRecord(self.topic, event.generation_id, encode(event))

    def _drain(self, first_wait_s: float | int) -> list[SpoolRecord]:
        """Up to a batch of queued records: with `first_wait_s`, wait that long for the first
        and then up to `linger_s` for more; without, what is queued now."""
        events: list[GenerationLogged] = []
        try:
            if first_wait_s:
                events.append(self._queue.get(timeout=float(first_wait_s)))
                self._stop.wait(self._linger_s)  # one wake-up, not one per record
            while len(events) < self._batch_size:
                events.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        self._inflight = len(events)
        return [self._record(e) for e in events]

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.spool.pending_records:
                if not self._replay():
                    while records := self._drain(0):  # new records queue behind the spool
                        self._spill(records)
                    self._stop.wait(self._retry_s)
                continue
            records = self._drain(0.05)
            if records:
                failed = self._send(records)
                with self._counts:
                    self._sent += len(records) - len(failed)
                self._spill(failed)
            self._inflight = 0

    def _spill(self, records: list[SpoolRecord]) -> None:
        if records:
            self.spool.append(records)
            with self._counts:
                self._spilled += len(records)
            log.warning("session log: %d records spooled (Kafka unreachable)", len(records))
        self._inflight = 0

    def _replay(self) -> bool:
        records, end = self.spool.read(self._batch_size)
        if self._send(records):
            return False
        self.spool.commit(end)
        self._replayed += len(records)
        return True

    def _send(self, records: list[SpoolRecord]) -> list[SpoolRecord]:
        """Produce `records` and wait for their acks; return those not acknowledged."""
        try:
            if self._producer is None:
                self._producer = EventProducer(self.config, client_id="flywheel-session-log")
            futures = [self._producer.send_raw(r.topic, r.key, r.value) for r in records]
            self._producer.flush(timeout_s=self.config.delivery_timeout_ms / 1000 + 1)
        except (KafkaError, OSError) as exc:
            log.warning("session log: Kafka unavailable (%s)", exc)
            self._reset_producer()
            return records
        failed = [r for r, f in zip(records, futures, strict=True)
                  if not (f.is_done and f.succeeded())]
        if failed:
            self._reset_producer()
        return failed

    def _reset_producer(self) -> None:
        """A fresh producer after a failure: expired batches leave the idempotent one stuck."""
        if self._producer is not None:
            self._producer.abandon()
        self._producer = None
