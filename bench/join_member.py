"""One join member, in this process, over a feedback backlog whose sessions it read first.

    .venv/bin/python bench/join_member.py [--events 40000] [--sessions 5000]

The piece of `bench/feedback.py` to profile (`py-spy record --pid …` once it prints
`ready`) or to compare two versions of the join with (alternate runs: on a shared 2-core
machine one run's CPU per event moves by ±10%). Produces the sessions and the feedback
straight to an embedded broker (no HTTP), reads the sessions untimed, then times the
feedback: events/s, CPU µs per event of this process, and the join loop's idle µs per event
(wall time its thread spent off the CPU: waiting for the broker, SQLite or the interpreter
lock). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.heap import settle_heap  # noqa: E402
from app.settings import Settings  # noqa: E402
from bench.feedback import event, produce_sessions  # noqa: E402
from ingest.broker import EmbeddedBroker  # noqa: E402
from ingest.events import FeedbackReceived, encode  # noqa: E402
from ingest.log import EventProducer  # noqa: E402


def produce_feedback(settings: Settings, generations: list[str], count: int) -> None:
    kafka = settings.kafka_config(str(settings.kafka_bootstrap))
    producer = EventProducer(kafka)
    records = [(generations[i % len(generations)],
                encode(FeedbackReceived.model_validate(event(generations, i))))
               for i in range(count)]
    for start in range(0, count, 1000):
        producer.deliver(kafka.topics.feedback, records[start:start + 1000], timeout_s=30)
    producer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=40_000)
    parser.add_argument("--sessions", type=int, default=5000)
    args = parser.parse_args()
    from ingest.join import Join

    data = Path(tempfile.mkdtemp(prefix="bench-join-"))
    broker = EmbeddedBroker.start(log_path=data / "broker.log")
    try:
        settings = Settings(data_dir=data, kafka_bootstrap=broker.bootstrap)
        kafka = settings.kafka_config(broker.bootstrap)
        generations = [f"gen-{uuid.uuid4().hex}" for _ in range(args.sessions)]
        produce_sessions(settings, generations)
        produce_feedback(settings, generations, args.events)
        join = Join(kafka, settings.join.model_copy(update={"group_id": uuid.uuid4().hex}),
                    database_url=f"sqlite:///{data / 'join.db'}")

        def hold_feedback(partitions: set) -> None:  # type: ignore[type-arg]
            join.consumer.pause({tp for tp in partitions if tp.topic == kafka.topics.feedback})

        join.consumer.on_assigned.append(hold_feedback)
        while join.stats.sessions < len(generations):
            join.step()
        join.consumer.on_assigned.remove(hold_feedback)
        join.consumer.resume()
        settle_heap()  # as `flywheel join` does
        print(f"ready: pid {os.getpid()}", flush=True)
        wall, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
        while join.stats.experiences < args.events:
            join.step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        main = time.thread_time() - main
        join.close()
    finally:
        broker.stop()
    events_per_s, cpu_us = args.events / wall, cpu / args.events * 1e6
    idle_us = (wall - main) / args.events * 1e6
    print(f"join x1, sessions first: {events_per_s:.0f} feedback events/s, "
          f"CPU {cpu_us:.1f} µs/event, join loop idle {idle_us:.1f} µs/event ({args.events} "
          f"events, {args.sessions} sessions)")
    print(json.dumps({"bench": "join_member", "events_per_s": round(events_per_s, 1),
                      "cpu_us_per_event": round(cpu_us, 1),
                      "loop_idle_us_per_event": round(idle_us, 1), "events": args.events,
                      "sessions": args.sessions}))


if __name__ == "__main__":
    main()
