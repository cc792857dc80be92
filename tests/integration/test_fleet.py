"""The rollout fleet on a real broker: two `flywheel rollout-worker` processes, one SIGKILLed
mid-run; every job ends once, the dead worker's jobs are remade by the other, and the survivor
ends on the trainer's exact weights."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ingest.config import KafkaConfig
from kernels.weights import state_dict_sha256
from tests.conftest import skilled_model


def worker_env(kafka: KafkaConfig, store: Path, data_dir: Path) -> dict[str, str]:
    env = {**os.environ, "FLYWHEEL_KAFKA_BOOTSTRAP": kafka.bootstrap,
           "FLYWHEEL_BOOTSTRAP__POLICY_STORE_URL": str(store),
           "FLYWHEEL_BOOTSTRAP__GROUPS_IN_FLIGHT": "2", "FLYWHEEL_DATA_DIR": str(data_dir)}
    for name in ("rollout_jobs", "rollouts", "policy", "dlq"):
        env[f"FLYWHEEL_TOPICS__{name.upper()}"] = getattr(kafka.topics, name)
    return env


def start_worker(name: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "app.cli", "rollout-worker",
                                 "--worker-id", name], stdout=out, stderr=subprocess.STDOUT,
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


@pytest.fixture(scope="module")
def learning_model_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mid-trained until it solves its two tasks some of the time: groups with a signal, so
    every step changes the weights and every policy version is a real delta."""
    return skilled_model(model_dir, tmp_path_factory.mktemp("fleet"), steps=80)


def test_a_killed_worker_loses_nothing_and_the_survivor_ends_on_the_trainers_weights(
        kafka: KafkaConfig, learning_model_dir: Path, tmp_path: Path) -> None:
    from simulate.rollouts import SandboxCache
    from simulate.tasks import JsonlTasksConfig, build_task_source
    from trainer.bootstrap_config import BootstrapSettings
    from trainer.offline import run_grpo
    from trainer.policy import Policy

    store = tmp_path / "policy"
    cfg = BootstrapSettings(group_size=4, groups_per_step=4, groups_in_flight=2, max_tokens=64,
                            max_turns=2, max_steps=12, time_budget_s=600, rollout_workers=0,
                            policy_store_url=str(store), lr=1e-3)
    tasks = build_task_source(JsonlTasksConfig(path=learning_model_dir / "tasks.jsonl",
                                               held_out_fraction=0.0)).tasks()
    policy = Policy.load(learning_model_dir, lr=cfg.lr)
    start_sha = state_dict_sha256(policy.state_dict())
    env = worker_env(kafka, store, tmp_path / "data")
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b")}
    workers = {name: start_worker(name, env, log) for name, log in logs.items()}
    result: dict[str, Any] = {}

    def train() -> None:
        try:
            result["run"] = run_grpo(policy, cfg, tasks, [],
                                     cache=SandboxCache(), kafka=kafka,
                                     work_dir=tmp_path / "run", progress=False)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test below
            result["error"] = exc

    trainer = threading.Thread(target=train, daemon=True)
    try:
        trainer.start()
        wait_for_line(logs["a"], r"making \S+ on v", timeout_s=120)
        workers["a"].send_signal(signal.SIGKILL)
        workers["a"].wait(timeout=10)
        trainer.join(timeout=300)
        assert not trainer.is_alive(), "the bootstrap did not finish"
        assert "error" not in result, result.get("error")
        run = result["run"]
        assert run.steps == cfg.max_steps
        jobs = [json.loads(line) for line in
                (tmp_path / "run" / "jobs.jsonl").read_text().splitlines()]
        # every job ended exactly once: admitted, or discarded with the reason
        for job in jobs:
            assert (job["admitted_from"] is None) != (job["discarded"] is None), job
        trained = [j for j in jobs if j["step"] < policy.version]  # every step's groups
        assert len(trained) == cfg.max_steps * cfg.groups_per_step
        assert all(j["admitted_from"] for j in trained)
        admitted = {j["job_id"]: j["admitted_from"] for j in jobs if j["admitted_from"]}
        lost = started_jobs(logs["a"]) - {j for j, w in admitted.items() if w == "a"}
        assert lost, "worker a was killed before delivering anything it had started"
        assert all(admitted.get(job) == "b" for job in lost if job in admitted), (
            lost, admitted)
        assert run.fleet["by_worker"].get("b", 0) > 0
        # the survivor follows the last version too (its delta, verified) and holds exactly
        # the trainer's weights
        sha = state_dict_sha256(policy.state_dict())
        assert sha != start_sha and run.fleet["delta_bytes_per_version"] > 0
        wait_for_line(logs["b"], rf"on v{policy.version} sha256 {sha}", timeout_s=60)
    finally:
        for proc in workers.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in workers.values():
            proc.wait(timeout=30)
