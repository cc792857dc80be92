"""Helpers of the integration tests: a chat load on a running stack and its replica's swaps
(tests/integration/test_releases.py), a `flywheel join` subprocess, and experiences produced to
Kafka for the online trainer's chaos tests."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import torch

from app.settings import Settings
from ingest.config import KafkaConfig
from ingest.log import EventProducer
from tests.trainer.helpers import make_checkpoint, make_experiences

CLIENTS = 16


class Load:
    """16 concurrent chat clients on their own event loop, recording every outcome."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.stop = threading.Event()
        self.fingerprints: list[str] = []
        self.failures: list[str] = []
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _client(self, http: httpx.AsyncClient, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                r = await http.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": f"def f{i}_{n}(x):"}],
                    "max_tokens": 4, "temperature": 0.8})
            except httpx.HTTPError as exc:
                self.failures.append(f"client {i}: {exc!r}")
                continue
            if r.status_code != 200:
                self.failures.append(f"client {i}: {r.status_code} {r.text[:200]}")
            else:
                self.fingerprints.append(r.json()["system_fingerprint"])

    async def _main(self) -> None:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=120) as http:
            await asyncio.gather(*(self._client(http, i) for i in range(CLIENTS)))


def wait_for(predicate, what: str, timeout_s: float = 60.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def replica_status(http: httpx.Client) -> dict:
    return http.get("/admin/status").json()["replica"]


def swapped_to(http: httpx.Client, version: int, timeout_s: float = 60.0) -> dict:
    """The replica's status once its last swap is to `version`."""
    return wait_for(lambda: (s := replica_status(http))["last_swap"] is not None
                    and s["last_swap"]["version"] == version and s, f"swap to v{version}",
                    timeout_s)


def release_candidate(http: httpx.Client, model_dir: Path, ckpt: Path, *, seed: int,
                      reason: str, scale: float = 1e-3,
                      base: dict[str, torch.Tensor] | None = None
                      ) -> tuple[int, dict[str, torch.Tensor]]:
    """A trainer checkpoint (`base` plus seeded noise) at `ckpt`, released through the admin
    API: (the version it will be, its weights)."""
    weights = make_checkpoint(model_dir, ckpt, scale=scale, seed=seed, base=base)
    r = http.post("/admin/releases", json={"candidate": str(ckpt), "reason": reason})
    assert r.status_code == 202, r.text
    return r.json()["version"], weights


class JoinProcess:
    """`python -m app.cli join` as a subprocess, stopped by the PID it holds."""

    def __init__(self, settings: Settings, data_dir: Path, group: str, database: Path, *,
                 env: dict[str, str] | None = None) -> None:
        topics = settings.topics
        self.env = {**os.environ, "FLYWHEEL_KAFKA_BOOTSTRAP": str(settings.kafka_bootstrap),
                    "FLYWHEEL_DATA_DIR": str(data_dir), "FLYWHEEL_JOIN__GROUP_ID": group,
                    "FLYWHEEL_JOIN__DATABASE_URL": f"sqlite:///{database}",
                    **{f"FLYWHEEL_TOPICS__{name.upper()}": getattr(topics, name)
                       for name in ("sessions", "feedback", "experiences", "dlq")},
                    **(env or {})}
        self.log = data_dir / "join.log"
        data_dir.mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "app.cli", "join"],
                                            env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        assert self.process is not None and self.process.poll() is None, self.log.read_text()
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> str:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
        return self.log.read_text()


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 60.0,
               detail: Callable[[], str] = str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {detail()}"
        time.sleep(0.2)


EXPERIENCES = 160
DUPLICATES = 6


def produce_experiences(kafka: KafkaConfig, model_dir: Path) -> list:
    experiences = make_experiences(model_dir, EXPERIENCES, seed=7)
    producer = EventProducer(kafka, client_id="chaos-test")
    rng = random.Random(3)
    replays = rng.sample(experiences, DUPLICATES)
    for exp in experiences + replays:
        producer.send(kafka.topics.experiences, exp.experience_id, exp)
    producer.flush(timeout_s=30)
    producer.close()
    return experiences


def logprobs_at(model_dir: Path, weights: dict[str, torch.Tensor], prompt: list[int],
                tokens: list[int]) -> torch.Tensor:
    """Each of `tokens`' logprobs after `prompt`, by the trainer's model at `weights`: what a
    replica that sampled them with those weights should have reported."""
    from trainer.release.weights import load_model

    model = load_model(model_dir)
    model.load_state_dict(weights)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
