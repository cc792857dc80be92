"""Run the whole stack in one process: broker (embedded unless configured), API server.

Used by `flywheel up`, `flywheel demo` and the integration tests, so all three start the
system the same way.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from app.settings import Settings
from ingest.broker import EmbeddedBroker, free_port
from ingest.config import KafkaConfig


class StackStartError(RuntimeError):
    """The API did not come up; the message carries the reason."""


@dataclass
class RunningStack:
    settings: Settings
    kafka: KafkaConfig
    base_url: str
    broker: EmbeddedBroker | None


@contextlib.contextmanager
def running_broker(settings: Settings) -> Iterator[tuple[str, EmbeddedBroker | None]]:
    if settings.kafka_bootstrap:
        yield settings.kafka_bootstrap, None
        return
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    broker = EmbeddedBroker.start(log_path=Path(settings.data_dir) / "broker.log")
    try:
        yield broker.bootstrap, broker
    finally:
        broker.stop()


@contextlib.contextmanager
def running_stack(settings: Settings, *, start_timeout_s: float | None = 120.0
                  ) -> Iterator[RunningStack]:
    """Start broker + API (uvicorn on a thread); yield when `/healthz` answers. Raises if the
    API's start-up fails, or lasts past `start_timeout_s` (None: as long as it is alive)."""
    import uvicorn

    from app.api.main import create_app

    with running_broker(settings) as (bootstrap, broker):
        port = settings.port or free_port(settings.host)
        settings = settings.model_copy(update={"kafka_bootstrap": bootstrap, "port": port})
        server = uvicorn.Server(uvicorn.Config(create_app(settings), host=settings.host,
                                               port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
        thread.start()
        deadline = time.monotonic() + (start_timeout_s or float("inf"))
        while not server.started:
            if not thread.is_alive():
                raise StackStartError("API server exited during start-up (see log above)")
            if time.monotonic() > deadline:
                server.should_exit = True
                raise StackStartError(f"API did not start in {start_timeout_s}s")
            time.sleep(0.05)
        try:
            yield RunningStack(settings=settings, kafka=settings.kafka_config(bootstrap),
                               base_url=f"http://{settings.host}:{port}", broker=broker)
        finally:
            server.should_exit = True
            thread.join(timeout=30)
