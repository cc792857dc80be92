"""Off-peak scavenging: a serving replica (the app, in this process) makes rollouts for a
running bootstrap while nobody calls it, and hands its batch back the moment users do."""

from __future__ import annotations

import json
import logging
import re
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.cli.stack import running_stack
from app.settings import Settings
from ingest.config import KafkaConfig
from simulate.scavenge import ScavengeSettings
from tests.integration.fleet_helpers import Training, start_worker, worker_env
from tests.integration.helpers import wait_for


def messages(caplog: pytest.LogCaptureFixture, pattern: str) -> list[re.Match[str]]:
    return [m for r in caplog.records if (m := re.search(pattern, r.getMessage()))]


@pytest.mark.timeout(400)
def test_a_quiet_replica_scavenges_and_yields_to_users(
        settings: Settings, kafka: KafkaConfig, learning_model_dir: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="simulate")
    store = tmp_path / "policy"
    settings = settings.model_copy(update={
        "model_dir": learning_model_dir,
        "scavenge": ScavengeSettings(enabled=True, store_url=str(store), quiet_s=1.0)})
    training = Training(kafka, learning_model_dir, store, tmp_path / "run", max_steps=10,
                        time_budget_s=300)
    other = start_worker("b", worker_env(kafka, store, tmp_path / "b"), tmp_path / "b.log")
    admin = {"Authorization": f"Bearer {settings.admin_secret().get_secret_value()}"}
    users_stop, failures = threading.Event(), []
    try:
        with running_stack(settings) as stack, httpx.Client(
                base_url=stack.base_url, timeout=60, headers=admin) as http:
            def status() -> dict[str, Any]:
                return http.get("/admin/status").json()

            served = status()["model_sha256"]
            training.thread.start()
            # quiet: the replica joins the workers and delivers groups of its own
            wait_for(lambda: status()["scavenger"]["groups"] >= 1, "scavenged groups", 180)
            me = status()["scavenger"]["worker_id"]
            making = len(messages(caplog, rf"{me}: making"))
            wait_for(lambda: len(messages(caplog, rf"{me}: making")) > making,
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
            back = wait_for(lambda: messages(caplog, rf"{me}: preempted, handed back (\S+)"),
                            "the preemption", 30)
            handed_back = set(back[0].group(1).split(","))
            run = training.finish(timeout_s=300)
            users_stop.set()
            final = status()
        assert run.steps == training.cfg.max_steps and failures == []
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
