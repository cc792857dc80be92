"""The rollout fleet on a real broker: two `flywheel rollout-worker` processes, one SIGKILLed
mid-run; every job ends once, the dead worker's jobs are remade by the other, and the survivor
ends on the trainer's exact weights."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from ingest.config import KafkaConfig
from kernels.weights import state_dict_sha256
from tests.integration.fleet_helpers import (
    Training,
    assert_each_job_ended_once,
    start_worker,
    wait_for_line,
    worker_command,
    worker_env,
)


def test_a_killed_worker_loses_nothing_and_the_survivor_ends_on_the_trainers_weights(
        kafka: KafkaConfig, learning_model_dir: Path, tmp_path: Path) -> None:
    store = tmp_path / "policy"
    training = Training(kafka, learning_model_dir, store, tmp_path / "run", max_steps=12,
                        time_budget_s=600)
    cfg, policy = training.cfg, training.policy
    start_sha = state_dict_sha256(policy.state_dict())
    env = worker_env(kafka, store, tmp_path / "data")
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b")}
    workers = {name: start_worker(name, env, log) for name, log in logs.items()}
    try:
        training.thread.start()
        wait_for_line(logs["a"], r"making \S+ on v", timeout_s=120)
        workers["a"].send_signal(signal.SIGKILL)
        workers["a"].wait(timeout=10)
        run = training.finish(timeout_s=300)
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


def test_an_agent_programs_worker_makes_the_groups_of_a_bootstrap(
        kafka: KafkaConfig, learning_model_dir: Path, tmp_path: Path) -> None:
    """`flywheel rollout-worker --agent builtin`: every episode a process of the built-in
    harness (forked from its warm host) over the worker's OpenAI endpoint; the run trains on
    those groups and the worker follows its versions."""
    store = tmp_path / "policy"
    training = Training(kafka, learning_model_dir, store, tmp_path / "run", max_steps=2,
                        time_budget_s=600)
    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [*worker_command("agent"), "--agent", "builtin"], stdout=out,
            stderr=subprocess.STDOUT, env=worker_env(kafka, store, tmp_path / "data"))
    try:
        training.thread.start()
        run = training.finish(timeout_s=600)
        assert run.steps == 2 and run.fleet["by_worker"] == {"agent": 8}
        assert run.fleet["agent_episodes_dropped"] == {}
        sha = state_dict_sha256(training.policy.state_dict())
        wait_for_line(log, rf"on v{training.policy.version} sha256 {sha}", timeout_s=60)
        assert "agent simulate.builtin_agent:main against http://127.0.0.1:" in log.read_text()
    finally:
        worker.terminate()
        worker.wait(timeout=30)
