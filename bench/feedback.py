"""Feedback webhook + join throughput on a real broker, real SQL and real signatures.

    .venv/bin/python bench/feedback.py [--single 4000] [--batch-events 200000] [--workers 1]
                                       [--join-procs <cores>] [--join-database-url URL]

Starts an embedded broker and the API (uvicorn subprocess, `--workers` processes), drives
`POST /v1/feedback` and `POST /v1/feedback/batch` at concurrency 32 over keep-alive HTTP/1.1
connections (a minimal asyncio client, so the client is not what is measured), each request
signed with HMAC-SHA256 at send time (bodies are built beforehand); then produces a session
for every generation and times the join: feedback events/s from its first timed record to its
last experience, with one process and with `--join-procs` processes in one consumer group
(each on its own partitions, one shared SQL state: a SQLite file, or with
`--join-database-url` a fresh schema per run on that PostgreSQL, as in production).
`join_events_per_s` is the production order: the group reads the sessions (untimed), then the
feedback backlog, so each event meets a stored session. `join_all_at_once_events_per_s` reads
both topics at once from the start: most feedback then comes before its session, is stored
pending and claimed later (the slow path, which production sees only when feedback outruns
the session log). Beside wall-clock rates it reports the CPU time each part spent per request
or event (server, broker, client; for the join its members, the broker and a local
PostgreSQL), which a loaded machine does not distort, and the load average. Ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.settings import Settings  # noqa: E402
from bench.proc_cpu import cpu_seconds, own_cpu_seconds  # noqa: E402
from ingest.broker import EmbeddedBroker, free_port  # noqa: E402
from ingest.events import GenerationLogged, PackedArray, SamplingParams  # noqa: E402
from ingest.signing import SIGNATURE_HEADER, sign  # noqa: E402

SECRET = "bench-secret"
CONCURRENCY = 32
USERS = 500  # distinct users the synthetic sessions belong to


def app_factory():  # type: ignore[no-untyped-def]  # uvicorn --factory, settings from env
    from app.api.main import create_app

    return create_app(Settings())


async def request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str,
                  body: bytes) -> int:
    head = (f"POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{SIGNATURE_HEADER}: {sign(SECRET, None, body)}"
            "\r\n\r\n").encode()
    writer.write(head + body)
    status_line = await reader.readline()
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    await reader.readexactly(length)
    return int(status_line.split()[1])


async def drive(port: int, path: str, bodies: list[bytes]) -> tuple[float, list[float]]:
    """Send `bodies` over CONCURRENCY connections; (wall seconds, per-request latencies)."""
    queue = list(reversed(bodies))
    latencies: list[float] = []

    async def worker() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while queue:
            body = queue.pop()
            t0 = time.perf_counter()
            status = await request(reader, writer, path, body)
            latencies.append(time.perf_counter() - t0)
            assert status == 202, status
        writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return time.perf_counter() - started, latencies


def event(generations: list[str], i: int) -> dict[str, object]:
    return {"event_id": f"evt-{uuid.uuid4().hex}", "generation_id": generations[i % len(
        generations)], "kind": ["accept", "thumbs_down", "reject"][i % 3]}


def postgres_cpu_seconds() -> float:
    """CPU seconds of every live PostgreSQL process on this machine (server, backends,
    workers): the join's database cost when its state is on a local PostgreSQL."""
    total = 0.0
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "comm").read_text().strip() == "postgres":
                total += own_cpu_seconds(int(proc.name))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


class CpuMeter:
    """CPU seconds spent by the server, the broker and this process over one phase."""

    def __init__(self, server: int, broker: int) -> None:
        self.pids = {"server": server, "broker": broker}
        self.start = self._now()

    def _now(self) -> dict[str, float]:
        now = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        return {**now, "client": time.process_time()}

    def per(self, count: int) -> dict[str, float]:
        """Microseconds of CPU per item since construction, by part."""
        end = self._now()
        return {name: round((end[name] - self.start[name]) / count * 1e6, 1) for name in end}


def run_loop(coro):  # type: ignore[no-untyped-def]
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvicorn[standard] brings it
        return asyncio.run(coro)
    return uvloop.run(coro)


def wait_healthy(port: int, timeout_s: float = 180) -> None:
    from bench.servers import wait_answering

    wait_answering(f"http://127.0.0.1:{port}", "/healthz", timeout_s=timeout_s)


@dataclass
class JoinRun:
    """What `bench_join` measured: feedback events per second, from the group's first timed
    record to the last experience, and CPU microseconds per feedback event summed over its
    members (sessions read in that time included), with the broker's and, for a local
    PostgreSQL, the database's over the same span (from the feedback's go to the last
    experience; None for SQLite, which runs inside the members)."""

    procs: int
    sessions_first: bool
    events_per_s: float
    cpu_us_per_event: float
    broker_cpu_us_per_event: float
    database_cpu_us_per_event: float | None


def _join_member(kafka: Any, settings: Any, database_url: str, index: int,
                 shared: dict[str, Any]) -> None:
    """One member of the bench's join group (a spawned process). Holds its partitions paused
    until the parent says go, so that every member is in the group before anything is read
    (a member joining later would stop the others for a rebalance). With `sessions_first`
    it reads its sessions partitions alone, untimed, then the feedback when told."""
    from app.heap import settle_heap
    from ingest.join import Join

    join = Join(kafka, settings, database_url=database_url)
    settle_heap()  # as `flywheel join` does
    go, feedback_go, assigned = shared["go"], shared["feedback_go"], shared["assigned"]

    def hold(partitions: set[Any]) -> None:
        if not go.is_set():
            join.consumer.pause(partitions)
        assigned[index] = len(partitions)

    def revoked(_partitions: set[Any]) -> None:
        assigned[index] = 0

    join.consumer.on_assigned.append(hold)
    join.consumer.on_revoked.append(revoked)
    while not go.is_set():
        join.consumer.poll(timeout_ms=100)  # joins the group and heartbeats; paused: no records
    if not feedback_go.is_set():  # sessions first: read them all, untimed
        join.consumer.resume({tp for tp in join.consumer.assignment()
                              if tp.topic == kafka.topics.sessions})
        while not feedback_go.is_set():
            join.step()
            shared["sessions"][index] = join.stats.sessions
    join.consumer.resume()
    first, cpu0 = 0.0, 0.0
    try:
        while not shared["stop"].is_set():
            before = time.perf_counter(), time.process_time()
            n = join.step()
            if n and not first:
                first, cpu0 = before
                shared["first"][index] = first
            shared["experiences"][index] = join.stats.experiences  # this member's slot only
        shared["cpu"][index] = time.process_time() - cpu0 if first else 0.0
    finally:
        join.close()


@contextmanager
def join_database(data: Path, server_url: str | None) -> Iterator[str]:
    """Fresh join state for one run: a new SQLite file under `data`, or a new schema on the
    PostgreSQL at `server_url` (dropped afterwards)."""
    if server_url is None:
        yield f"sqlite:///{data / f'join-{uuid.uuid4().hex}.db'}"
        return
    from tests.conftest import fresh_schema

    with fresh_schema(server_url) as url:
        yield url


def bench_join(settings: Settings, sessions: int, expected: int, database_url: str,
               procs: int, broker_pid: int, *, sessions_first: bool) -> JoinRun:
    """Run `procs` join processes in one group (fresh group, fresh SQL state) over the
    topics until every feedback event became an experience. `sessions_first`: the members
    read every session before the feedback (untimed), as in production, where a generation
    is logged before anyone judges it; else they read both topics at once, and most feedback
    comes before its session (stored, then claimed: the join's slow path)."""
    import multiprocessing

    from ingest.log import ensure_topics

    ctx = multiprocessing.get_context("spawn")
    kafka = settings.kafka_config(str(settings.kafka_bootstrap))
    # a topic of its own for each run's experiences: a join reads what is on the topic at
    # start and does not make again what it finds there (its recovery scan)
    kafka = kafka.model_copy(update={"topics": kafka.topics.model_copy(
        update={"experiences": f"experiences-{uuid.uuid4().hex[:8]}"})})
    ensure_topics(kafka)
    join_settings = settings.join.model_copy(update={"group_id": f"bench-{uuid.uuid4().hex}"})
    shared: dict[str, Any] = {
        "go": ctx.Event(), "feedback_go": ctx.Event(), "stop": ctx.Event(),
        "assigned": ctx.Array("i", procs), "sessions": ctx.Array("q", procs),
        "experiences": ctx.Array("q", procs), "first": ctx.Array("d", procs),
        "cpu": ctx.Array("d", procs)}
    members = [ctx.Process(target=_join_member, args=(kafka, join_settings, database_url, i,
                                                      shared)) for i in range(procs)]
    for m in members:
        m.start()

    def wait_for(done: Any, what: str) -> None:
        deadline = time.monotonic() + 120
        while not done():
            dead = [m.exitcode for m in members if not m.is_alive()]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"join group: {what}" + (f" (members exited {dead})"
                                                            if dead else " (timed out)"))
            time.sleep(0.005)

    postgres = database_url.startswith("postgresql")

    def other_cpu() -> tuple[float, float]:
        return cpu_seconds(broker_pid), postgres_cpu_seconds() if postgres else 0.0

    partitions = 2 * kafka.topics.partitions  # sessions + feedback
    try:
        wait_for(lambda: all(shared["assigned"][:]) and
                 sum(shared["assigned"][:]) == partitions, "did not form")
        if sessions_first:
            shared["go"].set()
            wait_for(lambda: sum(shared["sessions"][:]) >= sessions, "sessions not read")
            cpu0 = other_cpu()
            shared["feedback_go"].set()
        else:
            cpu0 = other_cpu()
            shared["feedback_go"].set()
            shared["go"].set()
        wait_for(lambda: sum(shared["experiences"][:]) >= expected, "experiences missing")
        done = time.perf_counter()
        broker_cpu, database_cpu = (b - a for a, b in zip(cpu0, other_cpu(), strict=True))
    finally:
        shared["stop"].set()
        for m in members:
            m.join(timeout=60)
            if m.is_alive():  # one still waiting for the group polls until killed
                m.kill()
    started = min(t for t in shared["first"][:] if t)
    return JoinRun(procs, sessions_first, expected / (done - started),
                   sum(shared["cpu"][:]) / expected * 1e6, broker_cpu / expected * 1e6,
                   database_cpu / expected * 1e6 if postgres else None)


def synthetic_session(generation_id: str, rng: np.random.Generator, *, layers: int = 2,
                      top_k: int = 2, user_id: str | None = None) -> GenerationLogged:
    """A valid GenerationLogged with random tokens, logprobs and routes (the join's tests use
    it too)."""
    p, t = int(rng.integers(4, 12)), int(rng.integers(1, 10))
    return GenerationLogged(
        generation_id=generation_id, request_id=generation_id, model_version=0,
        model_sha256="ab" * 32, prompt_token_ids=PackedArray.pack(rng.integers(0, 500, p), "int32"),
        completion_token_ids=PackedArray.pack(rng.integers(0, 500, t), "int32"),
        logprobs=PackedArray.pack(-rng.random(t), "float32"),
        routed_experts=PackedArray.pack(rng.integers(0, 8, (p + t - 1, layers, top_k)), "int16"),
        sampling=SamplingParams(temperature=0.8, max_tokens=t), finish_reason="length",
        latency_ms=3.0, user_id=user_id)


def produce_sessions(settings: Settings, generations: list[str]) -> None:
    from ingest.log import EventProducer

    kafka = settings.kafka_config(str(settings.kafka_bootstrap))
    producer = EventProducer(kafka)
    rng = np.random.default_rng(0)
    for i, g in enumerate(generations):  # as real traffic: every generation names its user
        producer.send(kafka.topics.sessions, g,
                      synthetic_session(g, rng, user_id=f"user-{i % USERS}"))
    producer.flush()
    producer.close()


def phase(port: int, path: str, bodies: list[bytes], meter_pids: tuple[int, int],
          events: int) -> tuple[float, list[float], dict[str, float]]:
    meter = CpuMeter(*meter_pids)
    seconds, latencies = run_loop(drive(port, path, bodies))
    return seconds, latencies, meter.per(events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--single", type=int, default=4000)
    # 200,000: the join's timed span must hold many polls per member; over 40,000 it lasted
    # about 1.5 s, a few polls each, and start-up dominated (docs/feedback.md)
    parser.add_argument("--batch-events", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--generations", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--join-procs", type=int, default=os.cpu_count() or 1,
                        help="join processes in one consumer group (also timed with one)")
    parser.add_argument("--join-database-url", default=None,
                        help="PostgreSQL for the join's state (a fresh schema per run), e.g. "
                             "postgresql+psycopg://postgres@127.0.0.1:5432/postgres; "
                             "default: a SQLite file")
    args = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="bench-feedback-"))
    broker = EmbeddedBroker.start(log_path=data / "broker.log")
    port = free_port()
    env = {**os.environ, "FLYWHEEL_KAFKA_BOOTSTRAP": broker.bootstrap,
           "FLYWHEEL_DATA_DIR": str(data), "FLYWHEEL_FEEDBACK_SECRETS": json.dumps([SECRET]),
           "FLYWHEEL_ENGINE__THREADS": "1", "FLYWHEEL_FEEDBACK_BATCH_MAX": "1000"}
    settings = Settings(data_dir=data, kafka_bootstrap=broker.bootstrap)
    from trainer.init_model import init_model

    init_model(settings.model, settings.resolved_model_dir)  # once, before the workers race
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "bench.feedback:app_factory", "--factory",
         "--port", str(port), "--workers", str(args.workers), "--log-level", "warning",
         "--no-access-log", "--http", "httptools", "--loop", "uvloop"],
        cwd=Path(__file__).resolve().parents[1], env=env)
    pids = (server.pid, broker.pid)
    try:
        wait_healthy(port)
        gens = [f"gen-{uuid.uuid4().hex}" for _ in range(args.generations)]
        warm = [json.dumps(event(gens, i)).encode() for i in range(200)]
        run_loop(drive(port, "/v1/feedback", warm))
        single = [json.dumps(event(gens, i)).encode() for i in range(args.single)]
        single_s, lat, single_cpu = phase(port, "/v1/feedback", single, pids, args.single)
        n_batches = args.batch_events // args.batch_size
        n_batch_events = n_batches * args.batch_size
        batches = [json.dumps({"events": [event(gens, b * args.batch_size + i)
                                          for i in range(args.batch_size)]}).encode()
                   for b in range(n_batches)]
        batch_s, _, batch_cpu = phase(port, "/v1/feedback/batch", batches, pids,
                                      n_batch_events)
    finally:
        server.terminate()
        server.wait(timeout=60)
    lat_ms = np.array(lat) * 1000
    single_rps = args.single / single_s
    batch_eps = n_batch_events / batch_s
    print(f"single: {args.single} req in {single_s:.2f}s = {single_rps:.0f} req/s, "
          f"p50 {np.percentile(lat_ms, 50):.1f} ms, p99 {np.percentile(lat_ms, 99):.1f} ms; "
          f"CPU us/req {single_cpu}")
    print(f"batch: {n_batches} x {args.batch_size} events in {batch_s:.2f}s = "
          f"{batch_eps:.0f} events/s; CPU us/event {batch_cpu}")
    expected = len(warm) + args.single + n_batch_events
    try:
        produce_sessions(settings, gens)

        def timed(procs: int, sessions_first: bool) -> JoinRun:
            with join_database(data, args.join_database_url) as url:
                return bench_join(settings, len(gens), expected, url, procs, broker.pid,
                                  sessions_first=sessions_first)

        runs = [timed(n, True) for n in sorted({1, args.join_procs})]
        worst = timed(args.join_procs, False)
    finally:
        broker.stop()
    for run in [*runs, worst]:
        print(f"join x{run.procs}, {'sessions first' if run.sessions_first else 'all at once'}:"
              f" {run.events_per_s:.0f} feedback events/s ({expected} events, {len(gens)} "
              f"sessions); CPU us/event: join {run.cpu_us_per_event:.1f}, broker "
              f"{run.broker_cpu_us_per_event:.1f}"
              + (f", database {run.database_cpu_us_per_event:.1f}"
                 if run.database_cpu_us_per_event is not None else ""))
    join = runs[-1]
    print(json.dumps({"bench": "feedback", "single_rps": round(single_rps, 1),
                      "single_p50_ms": round(float(np.percentile(lat_ms, 50)), 2),
                      "single_p99_ms": round(float(np.percentile(lat_ms, 99)), 2),
                      "batch_events_per_s": round(batch_eps, 1),
                      "join_events_per_s": round(join.events_per_s, 1),
                      "single_cpu_us_per_req": single_cpu,
                      "batch_cpu_us_per_event": batch_cpu,
                      "join_procs": join.procs,
                      "join_events_per_s_1proc": round(runs[0].events_per_s, 1),
                      "join_cpu_us_per_event": round(join.cpu_us_per_event, 1),
                      "join_broker_cpu_us_per_event": round(join.broker_cpu_us_per_event, 1),
                      **({"join_database_cpu_us_per_event":
                          round(join.database_cpu_us_per_event, 1)}
                         if join.database_cpu_us_per_event is not None else {}),
                      "join_all_at_once_events_per_s": round(worst.events_per_s, 1),
                      "join_database": "postgresql" if args.join_database_url else "sqlite",
                      "workers": args.workers, "cores": os.cpu_count(),
                      "loadavg_1m": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
