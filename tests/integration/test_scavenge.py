"""Off-peak scavenging: a serving replica (the app, in this process) makes rollouts for a
running bootstrap while nobody calls it, and hands its batch back the moment users do."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.settings import Settings
from app.stack import running_stack
from ingest.config import KafkaConfig
from simulate.scavenge import ScavengeSettings
from tests.integration.fleet_helpers import start_worker, worker_env


def wait_until(predicate: Any, what: str, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def messages(caplog: pytest.LogCaptureFixture, pattern: str) -> list[re.Match[str]]:
    return [m for r in caplog.records if (m := re.search(pattern, r.getMessage()))]


@pytest.mark.timeout(400)
def test_a_quiet_replica_scavenges_and_yields_to_users(
        settings: Settings, kafka: KafkaConfig, learning_model_dir: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    from simulate.rollouts import SandboxCache
    from simulate.tasks import JsonlTasksConfig, build_task_source
    from trainer.bootstrap_config import BootstrapSettings
    from trainer.offline import run_grpo
    from trainer.policy import Policy

    caplog.set_level(logging.INFO, logger="simulate")
    store = tmp_path / "policy"
    settings = settings.model_copy(update={
        "model_dir": learning_model_dir,
        "scavenge": ScavengeSettings(enabled=True, store_url=str(store), quiet_s=1.0)})
    cfg = BootstrapSettings(group_size=4, groups_per_step=4, groups_in_flight=2, max_tokens=64,
                            max_turns=2, max_steps=10, time_budget_s=300, rollout_workers=0,
                            policy_store_url=str(store), lr=1e-3)
    tasks = build_task_source(JsonlTasksConfig(path=learning_model_dir / "tasks.jsonl",
                                               held_out_fraction=0.0)).tasks()
    policy = Policy.load(learning_model_dir, lr=cfg.lr)
    result: dict[str, Any] = {}

    def train() -> None:
        try:
            result["run"] = run_grpo(policy, cfg, tasks, [], cache=SandboxCache(), kafka=kafka,
                                     work_dir=tmp_path / "run", progress=False)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test below
            result["error"] = exc

    other = start_worker("b", worker_env(kafka, store, tmp_path / "b"), tmp_path / "b.log")
    admin = {"Authorization": f"Bearer {settings.admin_token.get_secret_value()}"}
    trainer = threading.Thread(target=train, daemon=True)
    users_stop, failures = threading.Event(), []
    try:
        with running_stack(settings) as stack, httpx.Client(
                base_url=stack.base_url, timeout=60, headers=admin) as http:
            def status() -> dict[str, Any]:
                return http.get("/admin/status").json()

            served = status()["model_sha256"]
            trainer.start()
            # quiet: the replica joins the workers and delivers groups of its own
            wait_until(lambda: status()["scavenger"]["groups"] >= 1, "scavenged groups", 180)
            me = status()["scavenger"]["worker_id"]
            making = len(messages(caplog, rf"{me}: making"))
            wait_until(lambda: len(messages(caplog, rf"{me}: making")) > making,
                       "the scavenger's next batch", 120)

            def users() -> None:  # users return mid-batch, and stay
                with httpx.Client(base_url=stack.base_url, timeout=60) as client:
                    while not users_stop.is_set():
                        r = client.post("/v1/chat/completions", json={
                            "messages": [{"role": "user", "content": "def f(x):"}],
                            "max_tokens": 8})
                        if r.status_code != 200:
                            failures.append(r.text)

            threading.Thread(target=users, daemon=True).start()
            back = wait_until(lambda: messages(caplog, rf"{me}: preempted, handed back (\S+)"),
                              "the preemption", 30)
            handed_back = set(back[0].group(1).split(","))
            trainer.join(timeout=300)
            users_stop.set()
            final = status()
        assert not trainer.is_alive() and "error" not in result, result.get("error")
        run = result["run"]
        assert run.steps == cfg.max_steps and failures == []
        scavenger = final["scavenger"]
        assert scavenger["error"] is None and scavenger["preemptions"] >= 1
        assert scavenger["jobs_handed_back"] >= len(handed_back)
        assert run.fleet["by_worker"].get(me, 0) == scavenger["groups"] >= 1
        # the handed-back jobs were made by the other worker (the replica stayed out)
        jobs = [json.loads(line) for line in
                (tmp_path / "run" / "jobs.jsonl").read_text().splitlines()]
        admitted = {j["job_id"]: j["admitted_from"] for j in jobs}
        assert {admitted[job] for job in handed_back} == {"b"}, (handed_back, admitted)
        # it rolled out with its own copy of the policy; the served model never moved
        assert scavenger["policy_version"] is not None and final["model_sha256"] == served
    finally:
        users_stop.set()
        other.terminate()
        other.wait(timeout=30)
