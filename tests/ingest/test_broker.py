"""The embedded broker starts on a free loopback port, answers Kafka, and stops by PID."""

from __future__ import annotations

import os

import pytest

from ingest.broker import BrokerStartError, EmbeddedBroker, open_broker, wait_until_answering


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_start_answer_stop() -> None:
    broker = EmbeddedBroker.start()
    try:
        assert broker.bootstrap.startswith("127.0.0.1:")
        wait_until_answering(broker.bootstrap, timeout_s=5)
        pid = broker.pid
    finally:
        broker.stop()
    broker.process.wait()
    assert not pid_alive(pid) or broker.process.returncode is not None


def test_open_broker_uses_a_configured_cluster_without_starting_one(
        broker: EmbeddedBroker) -> None:
    with open_broker(broker.bootstrap) as bootstrap:
        assert bootstrap == broker.bootstrap


def test_unreachable_broker_is_a_clear_error() -> None:
    with pytest.raises(BrokerStartError, match="did not answer"):
        wait_until_answering("127.0.0.1:1", timeout_s=1)
