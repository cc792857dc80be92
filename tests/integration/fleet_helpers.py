"""What the fleet tests share: starting `flywheel rollout-worker` processes, reading their
logs, and the ledger's exactly-once check after a worker was SIGKILLed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

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


class Training:
    """GRPO on a skilled model's tasks (`skilled_model`: `tasks.jsonl` beside it) over the
    fleet on `kafka`, with no workers of its own, on a thread: `thread.start()`, then
    `finish()` for the run."""

    def __init__(self, kafka: KafkaConfig, model_dir: Path, store: Path, run_dir: Path, *,
                 max_steps: int, time_budget_s: float) -> None:
        from simulate.tasks import JsonlTasksConfig, build_task_source
        from trainer.bootstrap.config import BootstrapSettings
        from trainer.policy import Policy

        self.kafka, self.run_dir = kafka, run_dir
        self.cfg = BootstrapSettings(
            group_size=4, groups_per_step=4, groups_in_flight=2, max_tokens=64, max_turns=2,
            max_steps=max_steps, time_budget_s=time_budget_s, rollout_workers=0,
            policy_store_url=str(store), lr=1e-3)
        self.tasks = build_task_source(JsonlTasksConfig(path=model_dir / "tasks.jsonl",
                                                        held_out_fraction=0.0)).tasks()
        self.policy = Policy.load(model_dir, lr=self.cfg.lr)
        self.result: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._train, daemon=True)

    def _train(self) -> None:
        from simulate.rollouts import SandboxCache
        from trainer.bootstrap.run import run_grpo

        try:
            self.result["run"] = run_grpo(self.policy, self.cfg, self.tasks, [],
                                          cache=SandboxCache(), kafka=self.kafka,
                                          work_dir=self.run_dir, progress=False)
        except BaseException as exc:  # noqa: BLE001 - re-raised by finish()
            self.result["error"] = exc

    def finish(self, timeout_s: float) -> Any:
        """The run (`trainer.bootstrap.run.GrpoRun`), once the thread ended without an error."""
        self.thread.join(timeout=timeout_s)
        assert not self.thread.is_alive(), "the bootstrap did not finish"
        assert "error" not in self.result, self.result.get("error")
        return self.result["run"]
