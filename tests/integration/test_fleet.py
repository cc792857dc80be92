"""The rollout fleet on a real broker: two `flywheel rollout-worker` processes, one SIGKILLed
mid-run; every job ends once, the dead worker's jobs are remade by the other, and the survivor
ends on the trainer's exact weights."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

from ingest.config import KafkaConfig
from kernels.weights import state_dict_sha256
from tests.integration.fleet_helpers import (
    assert_each_job_ended_once,
    start_worker,
    wait_for_line,
    worker_env,
)


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
        assert_each_job_ended_once(tmp_path / "run" / "jobs.jsonl",
                                   trained_slots=cfg.max_steps * cfg.groups_per_step,
                                   steps=policy.version, killed="a", killed_log=logs["a"],
                                   survivor="b")
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
