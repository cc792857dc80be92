"""What the fleet tests share: starting `flywheel rollout-worker` processes, reading their
logs, and the ledger's exactly-once check after a worker was SIGKILLed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from ingest.config import KafkaConfig


def worker_env(kafka: KafkaConfig, store: Path, data_dir: Path) -> dict[str, str]:
    env = {**os.environ, "FLYWHEEL_KAFKA_BOOTSTRAP": kafka.bootstrap,
           "FLYWHEEL_BOOTSTRAP__POLICY_STORE_URL": str(store),
           "FLYWHEEL_BOOTSTRAP__GROUPS_IN_FLIGHT": "2", "FLYWHEEL_DATA_DIR": str(data_dir)}
    for name in ("rollout_jobs", "rollouts", "policy", "dlq"):
        env[f"FLYWHEEL_TOPICS__{name.upper()}"] = getattr(kafka.topics, name)
    return env


def worker_command(name: str) -> list[str]:
    return [sys.executable, "-m", "app.cli", "rollout-worker", "--worker-id", name]


def start_worker(name: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(worker_command(name), stdout=out, stderr=subprocess.STDOUT,
                                env=env)


def wait_for_line(log: Path, pattern: str, timeout_s: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(errors="replace"))
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} not in {log} after {timeout_s}s:\n{log.read_text()}")


def started_jobs(log: Path) -> set[str]:
    return {job for line in re.findall(r"making (\S+) on v", log.read_text())
            for job in line.split(",")}


def assert_each_job_ended_once(jobs_path: Path, *, trained_slots: int, steps: int,
                               killed: str, killed_log: Path, survivor: str) -> None:
    """Every job in the run's ledger ended exactly once (admitted, or discarded with the
    reason), every trained slot was admitted, and the jobs `killed` began but never delivered
    were admitted from `survivor`."""
    jobs = [json.loads(line) for line in jobs_path.read_text().splitlines()]
    for job in jobs:
        assert (job["admitted_from"] is None) != (job["discarded"] is None), job
    trained = [j for j in jobs if j["step"] < steps]  # every step's groups
    assert len(trained) == trained_slots
    assert all(j["admitted_from"] for j in trained)
    admitted = {j["job_id"]: j["admitted_from"] for j in jobs if j["admitted_from"]}
    lost = started_jobs(killed_log) - {j for j, w in admitted.items() if w == killed}
    assert lost, f"worker {killed} was killed before delivering anything it had started"
    assert all(admitted.get(job) == survivor for job in lost if job in admitted), (
        lost, admitted)
