"""Feedback webhook + join throughput on a real broker, real SQL and real signatures.

    .venv/bin/python bench/feedback.py [--single 4000] [--batch-events 40000] [--workers 1]

Starts an embedded broker and the API (uvicorn subprocess, `--workers` processes), drives
`POST /v1/feedback` and `POST /v1/feedback/batch` at concurrency 32 over keep-alive HTTP/1.1
connections (a minimal asyncio client, so the client is not what is measured), each request
signed with HMAC-SHA256 at send time (bodies are built beforehand); then produces a session
for every generation and times `ingest.join.Join` over everything (records/s from its first
record to its last experience). Beside wall-clock rates it reports the CPU time each part
spent per request or record (server, broker, client, join), which a loaded machine does not
distort, and the load average. Ends with one JSON line.
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
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.settings import Settings  # noqa: E402
from ingest.broker import EmbeddedBroker, free_port  # noqa: E402
from ingest.signing import SIGNATURE_HEADER, sign  # noqa: E402

SECRET = "bench-secret"
CONCURRENCY = 32


def app_factory():  # type: ignore[no-untyped-def]  # uvicorn --factory, settings from env
    from app.main import create_app

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


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its live descendants (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total, pending = 0.0, [pid]
    while pending:
        p = pending.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
            for task in Path(f"/proc/{p}/task").iterdir():
                pending += [int(c) for c in (task / "children").read_text().split()]
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
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("API did not start")


def bench_join(settings: Settings, generations: list[str], expected: int,
               data: Path) -> tuple[float, float]:
    from ingest.join import Join
    from ingest.log import EventProducer
    from tests.ingest.test_join import synthetic_session

    kafka = settings.kafka_config(str(settings.kafka_bootstrap))
    producer = EventProducer(kafka)
    rng = np.random.default_rng(0)
    for g in generations:
        producer.send(kafka.topics.sessions, g, synthetic_session(g, rng))
    producer.flush()
    producer.close()
    join = Join(kafka, settings.join, database_url=f"sqlite:///{data / 'join.db'}")
    records, first, cpu0 = 0, None, 0.0
    while join.stats.experiences < expected:
        before = time.perf_counter(), time.process_time()
        n = join.step()
        if n and first is None:  # from the poll that brought the first records
            first, cpu0 = before
        records += n
    elapsed = time.perf_counter() - (first or time.perf_counter())
    cpu = time.process_time() - cpu0
    join.close()
    return records / elapsed, cpu / records * 1e6


def phase(port: int, path: str, bodies: list[bytes], meter_pids: tuple[int, int],
          events: int) -> tuple[float, list[float], dict[str, float]]:
    meter = CpuMeter(*meter_pids)
    seconds, latencies = run_loop(drive(port, path, bodies))
    return seconds, latencies, meter.per(events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--single", type=int, default=4000)
    parser.add_argument("--batch-events", type=int, default=40_000)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--generations", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=1)
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
        join_eps, join_cpu_us = bench_join(settings, gens, expected, data)
    finally:
        broker.stop()
    print(f"join: {join_eps:.0f} records/s ({expected} feedback + {len(gens)} sessions); "
          f"CPU us/record {join_cpu_us:.1f}")
    print(json.dumps({"bench": "feedback", "single_rps": round(single_rps, 1),
                      "single_p50_ms": round(float(np.percentile(lat_ms, 50)), 2),
                      "single_p99_ms": round(float(np.percentile(lat_ms, 99)), 2),
                      "batch_events_per_s": round(batch_eps, 1),
                      "join_events_per_s": round(join_eps, 1),
                      "single_cpu_us_per_req": single_cpu,
                      "batch_cpu_us_per_event": batch_cpu,
                      "join_cpu_us_per_record": round(join_cpu_us, 1),
                      "workers": args.workers, "cores": os.cpu_count(),
                      "loadavg_1m": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
