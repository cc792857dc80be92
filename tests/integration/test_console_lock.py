"""`GET /admin/console` asks Kafka for figures; while it waits, the API's SQLite database stays
writable. Every SQLite transaction of the app takes the write lock when it begins
(ingest/sql.py), so a route that kept its session open across a Kafka call locked out the
feedback intake and `/admin/status` for as long as the broker took (a demo died of it)."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest

from app.cli.stack import running_stack
from app.settings import Settings
from ingest.broker import EmbeddedBroker

pytestmark = pytest.mark.integration


def test_console_figures_keep_no_database_lock_while_the_broker_is_frozen(
        tmp_path: Path, model_dir: Path) -> None:
    broker = EmbeddedBroker.start(log_path=tmp_path / "broker.log")  # ours alone to freeze
    settings = Settings(data_dir=tmp_path / "data", kafka_bootstrap=broker.bootstrap,
                        model_dir=model_dir, port=0, kafka={"request_timeout_ms": 4000})
    token = settings.admin_secret().get_secret_value()
    replies: list[int] = []
    try:
        with running_stack(settings) as stack:
            url = f"{stack.base_url}/admin/console"
            headers = {"Authorization": f"Bearer {token}"}
            broker.pause()
            asking = threading.Thread(target=lambda: replies.append(
                httpx.get(url, headers=headers, timeout=60).status_code))
            asking.start()
            time.sleep(1.5)  # the route has read the releases and waits on the broker
            assert asking.is_alive()
            path = stack.settings.resolved_database_url.removeprefix("sqlite:///")
            writer = sqlite3.connect(path, timeout=1.0, isolation_level=None)
            writer.execute("BEGIN IMMEDIATE")  # raises "database is locked" if the route holds it
            writer.execute("ROLLBACK")
            writer.close()
            broker.resume()
            asking.join(timeout=60)
    finally:
        broker.stop()
    assert replies == [200]
