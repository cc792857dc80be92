"""The session log loses nothing: the spool on its own, then the whole stack while the broker
is frozen (SIGSTOP) for longer than the producer's delivery timeout."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from app.cli.stack import running_stack
from app.settings import Settings
from ingest.broker import EmbeddedBroker
from ingest.events import GenerationLogged
from ingest.spool import Spool, SpoolRecord
from ingest.topic_reader import read_all

pytestmark = pytest.mark.integration


def records(n: int, start: int = 0) -> list[SpoolRecord]:
    return [SpoolRecord("sessions", f"gen-{i}", b'{"i": %d}' % i) for i in range(start, start + n)]


def test_spool_replays_in_order_across_reopen_and_drops_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "spool" / "sessions.jsonl"
    spool = Spool(path)
    spool.append(records(5))
    got, end = spool.read(3)
    assert [r.key for r in got] == ["gen-0", "gen-1", "gen-2"]
    spool.commit(end)
    spool.close()
    with open(path, "ab") as f:
        f.write(b'{"topic": "sessions", "key": "gen-torn", "va')  # a crash mid-append
    spool = Spool(path)
    assert spool.pending_records == 2
    spool.append(records(1, start=5))
    got, end = spool.read(100)
    assert [r.key for r in got] == ["gen-3", "gen-4", "gen-5"]
    assert got[0] == records(1, start=3)[0]
    spool.commit(end)
    assert (spool.pending_records, spool.pending_bytes, path.stat().st_size) == (0, 0, 0)
    spool.close()


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


# the producer the freeze made the log abandon closes once the broker is back, quietly
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning",
                            "error::pytest.PytestUnraisableExceptionWarning")
def test_fifty_requests_while_the_broker_is_frozen_all_reach_sessions(
        tmp_path: Path, model_dir: Path) -> None:
    broker = EmbeddedBroker.start(log_path=tmp_path / "broker.log")  # ours alone to freeze
    settings = Settings(data_dir=tmp_path / "data", kafka_bootstrap=broker.bootstrap,
                        model_dir=model_dir, port=0,
                        kafka={"request_timeout_ms": 1000, "delivery_timeout_ms": 2000})
    try:
        with running_stack(settings) as stack, httpx.Client(base_url=stack.base_url,
                                                            timeout=60) as http:
            warm = http.post("/v1/completions", json={"prompt": "def", "max_tokens": 2})
            ids = {warm.json()["id"]}
            while not read_all(stack.kafka, stack.kafka.topics.sessions, GenerationLogged):
                time.sleep(0.1)  # the session log is connected before the freeze

            async def fifty() -> list[str]:
                async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
                    replies = await asyncio.gather(*(client.post("/v1/completions", json={
                        "prompt": f"def f{i}(x):", "max_tokens": 4, "seed": i})
                        for i in range(50)))
                return [r.json()["id"] for r in replies]

            broker.pause()
            frozen_at = time.monotonic()
            ids |= set(asyncio.run(fifty()))
            spooled = 0.0  # frozen past the delivery timeout: all 50 end up in the spool
            while (spooled < 50 or time.monotonic() - frozen_at < 3.0) and \
                    time.monotonic() - frozen_at < 30:  # 3 s > the 2 s delivery timeout
                time.sleep(0.2)
                spooled = metric(http.get("/metrics").text, "flywheel_session_log_spool_records")
            print(f"\nfrozen for {time.monotonic() - frozen_at:.1f}s")
            broker.resume()
            resumed_at = time.monotonic()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                logged = read_all(stack.kafka, stack.kafka.topics.sessions, GenerationLogged)
                if ids <= {e.generation_id for e in logged}:
                    break
                time.sleep(0.5)
            after = http.get("/metrics").text
            print(f"all logged {time.monotonic() - resumed_at:.1f}s after resume")
    finally:
        broker.stop()

    counts = Counter(e.generation_id for e in logged)
    duplicates = sum(c - 1 for c in counts.values())
    print(f"\nsession log chaos: {len(ids)} generations, {spooled:.0f} spooled while frozen, "
          f"{len(logged)} records on sessions, {duplicates} duplicate records")
    assert len(ids) == 51
    assert set(counts) == ids  # every generation, nothing else
    assert spooled == 50  # the freeze really sent every record through the spool
    assert metric(after, "flywheel_session_log_spool_records") == 0
