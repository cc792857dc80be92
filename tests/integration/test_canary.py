"""A canary decided by users, end to end: the real broker, SQLite, the app's embedded Celery
worker, the tiny model on two engines, `flywheel join` and the app's canary watch.

Simulated agents keep opening two-turn sessions (each turn a chat completion under the
session's id) and send one signed verdict per session. Two releases go through
`POST /admin/releases` with the canary on (half the sessions):
- the first is judged worse by its users (they reject every session the candidate served and
  accept the incumbent's): the test rolls it back, the replica's primary engine never left
  version 0 (no swap), and the canary engine is closed;
- the second is judged like the incumbent: promoted, the replica hot-swaps to it, and the
  canary engine is closed.
Every turn of a session is served by one version; no request fails.

Then the failure planted in the weights: a candidate the online trainer made from the
developers' verdicts on a model that solves its tasks, every reward negated, is rolled back
by the canary on their real verdicts (the gate told to let it through).
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from app.cli.stack import running_stack
from app.settings import Settings
from ingest.events import ExperienceReady
from ingest.signing import SIGNATURE_HEADER, sign
from ingest.topic_reader import read_all
from tests.integration.helpers import (
    JoinProcess,
    release_candidate,
    replica_status,
    swapped_to,
    wait_for,
)
from trainer.release.config import CanarySettings, HeldOutLossEval
from trainer.release.weights import load_model

pytestmark = pytest.mark.integration
SECRET = "canary-secret"
AGENTS = 8


class Agents:
    """`AGENTS` agents on their own event loop: two-turn sessions, then a verdict that
    `judge(versions served)` gives."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.stop = threading.Event()
        self.rejected_version: int | None = None  # its sessions are rejected; others accepted
        self.failures: list[str] = []
        self.sessions: list[set[int]] = []  # the versions that served each session's turns
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _session(self, http: httpx.AsyncClient, i: int) -> None:
        session_id = f"agent{i}-{uuid.uuid4().hex[:12]}"
        messages: list[dict[str, object]] = [{"role": "user", "content": f"def f{i}(x):"}]
        versions = set()
        for turn in range(2):
            r = await http.post("/v1/chat/completions", json={
                "messages": messages, "max_tokens": 4, "temperature": 0.8,
                "session_id": session_id})
            if r.status_code != 200:
                self.failures.append(f"{session_id} turn {turn}: {r.status_code} {r.text}")
                return
            reply = r.json()
            versions.add(int(reply["system_fingerprint"].split("-")[1][1:]))
            messages += [reply["choices"][0]["message"], {"role": "user", "content": "go on"}]
        self.sessions.append(versions)
        kind = "reject" if self.rejected_version in versions else "accept"
        body = json.dumps({"event_id": f"v-{uuid.uuid4().hex}", "session_id": session_id,
                           "kind": kind, "source": "agent"}).encode()
        r = await http.post("/v1/feedback", content=body, headers={
            "content-type": "application/json", SIGNATURE_HEADER: sign(SECRET, None, body)})
        if r.status_code != 202:
            self.failures.append(f"{session_id} verdict: {r.status_code} {r.text}")

    async def _agent(self, http: httpx.AsyncClient, i: int) -> None:
        while not self.stop.is_set():
            try:
                await self._session(http, i)
            except httpx.HTTPError as exc:
                self.failures.append(f"agent {i}: {exc!r}")

    async def _main(self) -> None:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=120) as http:
            await asyncio.gather(*(self._agent(http, i) for i in range(AGENTS)))


def canary_of(http: httpx.Client, version: int) -> dict | None:
    found = [c for c in http.get("/admin/releases/canaries").json() if c["version"] == version]
    return found[0] if found else None


def ended(http: httpx.Client, version: int) -> dict | None:
    canary = canary_of(http, version)
    return canary if canary is not None and canary["status"] in ("promoted",
                                                                 "rolled_back") else None


def test_users_roll_back_a_worse_canary_and_promote_an_equal_one(
        settings: Settings, tmp_path: Path, model_dir: Path) -> None:
    canary = CanarySettings(enabled=True, share=0.5, min_sessions=20)
    settings = settings.model_copy(update={
        "feedback_secrets": [SecretStr(SECRET)],
        "release": settings.release.model_copy(update={
            "canary": canary, "eval": HeldOutLossEval(sequences=2, seq_len=64)})})
    admin = {"Authorization": f"Bearer {settings.admin_secret().get_secret_value()}"}
    join = JoinProcess(settings, tmp_path / "join", f"join-{uuid.uuid4().hex[:8]}",
                       tmp_path / "join.db", env={"FLYWHEEL_JOIN__SESSION_SETTLE_S": "0.5"})
    try:
        with running_stack(settings) as stack, httpx.Client(
                base_url=stack.base_url, timeout=60, headers=admin) as http:
            agents = Agents(stack.base_url)
            agents.thread.start()
            weights = load_model(model_dir).state_dict()

            # 1. worse by its users' verdicts: rolled back; the primary never left v0
            agents.rejected_version = 1
            worse, _ = release_candidate(http, model_dir, settings.data_dir / "c1.safetensors",
                                         seed=1, reason="worse", base=weights)
            assert worse == 1
            wait_for(lambda: (replica_status(http)["canary"] or {}).get("version") == worse,
                     "the canary served", 120)
            assert http.get(f"/admin/releases/{worse}").json()["status"] == "canary"
            first = wait_for(lambda: ended(http, worse), "the first canary's decision", 180)
            assert first["status"] == "rolled_back", first
            assert first["decided_by"] == "canary-test"
            acceptance = first["figures"]["acceptance"]
            assert acceptance["candidate_mean"] == 0.0 and acceptance["incumbent_mean"] == 1.0
            assert acceptance["candidate_sessions"] >= canary.min_sessions
            wait_for(lambda: replica_status(http)["canary"] is None, "the canary closed")
            status = replica_status(http)
            assert (status["version"], status["swaps"]) == (0, 0)  # the incumbent never left
            assert http.get(f"/admin/releases/{worse}").json()["status"] == "rolled_back"

            # 2. as good as the incumbent: promoted, and every replica swaps to it
            agents.rejected_version = None
            equal, _ = release_candidate(http, model_dir, settings.data_dir / "c2.safetensors",
                                         seed=2, reason="equal", base=weights)
            second = wait_for(lambda: ended(http, equal), "the second canary's decision", 180)
            assert second["status"] == "promoted", second
            promoted = swapped_to(http, equal)
            wait_for(lambda: replica_status(http)["canary"] is None, "the canary closed")
            assert http.get(f"/admin/releases/{equal}").json()["status"] == "published"
            agents.stop.set()
            agents.thread.join(timeout=120)
    finally:
        join.stop()

    assert agents.failures == []
    served = [v for v in agents.sessions if v & {1, equal}]
    assert served, "no session was served by a canary"
    mixed = [v for v in agents.sessions if len(v) > 1]  # only a decision mid-session mixes
    assert all(v in ({0, worse}, {0, equal}) for v in mixed), mixed
    builds = [round(r["prepare_s"], 3) for r in promoted["canary_swaps"]]
    print(f"\nsessions {len(agents.sessions)}; rolled back after "
          f"{acceptance['candidate_sessions']} + {acceptance['incumbent_sessions']} sessions, "
          f"promoted after {second['figures']['acceptance']['candidate_sessions']} + "
          f"{second['figures']['acceptance']['incumbent_sessions']}; canary engines prepared "
          f"in {builds} s; promotion's pause {promoted['last_swap']['paused_s'] * 1000:.1f} ms "
          f"(commit {promoted['last_swap']['copy_s'] * 1000:.1f} ms)")


def test_a_candidate_trained_on_inverted_rewards_is_rolled_back(
        settings: Settings, tmp_path: Path, model_dir: Path) -> None:
    """The failure planted in the weights: version 0 is the tiny model mid-trained until it
    solves its two tasks; simulated developers (simulate/developers.py) work on them through
    the API with function calling and judge each session by its hidden tests. The online
    trainer takes their joined verdicts with every reward negated and makes a candidate. The
    gate is told to let anything through (the canary is the line under test): the canary's
    test rolls it back on the developers' verdicts, the replica's primary never leaves
    version 0, and no request fails."""
    from simulate.developers import DeveloperPopulation, DeveloperSettings
    from simulate.harness import HarnessConfig
    from simulate.tasks import JsonlTasksConfig, build_task_source
    from tests.conftest import skilled_model
    from trainer.online.trainer import OnlineTrainer

    for folder in ("skilled", "developers"):
        (tmp_path / folder).mkdir()
    skilled = skilled_model(model_dir, tmp_path / "skilled", steps=120)
    tasks = build_task_source(JsonlTasksConfig(path=skilled / "tasks.jsonl",
                                               held_out_fraction=1.0)).tasks()
    settings = settings.model_copy(update={
        "model_dir": skilled, "feedback_secrets": [SecretStr(SECRET)],
        "release": settings.release.model_copy(update={
            "canary": CanarySettings(enabled=True, share=0.5, min_sessions=20),
            "eval": HeldOutLossEval(sequences=2, seq_len=64, max_regression=1e6)})})
    admin = {"Authorization": f"Bearer {settings.admin_secret().get_secret_value()}"}
    join = JoinProcess(settings, tmp_path / "join", f"join-{uuid.uuid4().hex[:8]}",
                       tmp_path / "join.db", env={"FLYWHEEL_JOIN__SESSION_SETTLE_S": "0.5"})
    stop = threading.Event()
    developers = DeveloperPopulation(
        "", tasks, secret=SECRET, workdir=tmp_path / "developers",
        settings=DeveloperSettings(concurrency=4, noise=0.0, max_delay_s=0.05,
                                   harness=HarnessConfig(max_turns=3, max_tokens=64)))
    try:
        with running_stack(settings) as stack, httpx.Client(
                base_url=stack.base_url, timeout=60, headers=admin) as http:
            developers.base_url = stack.base_url
            thread = threading.Thread(target=lambda: asyncio.run(
                developers.run(until=stop.is_set)), daemon=True)
            thread.start()
            kafka = stack.kafka
            wait_for(lambda: developers.stats.sessions >= 32, "v0's sessions", 240)
            wait_for(lambda: len(read_all(kafka, kafka.topics.experiences,
                                          ExperienceReady)) >= 64, "v0's judged turns", 60)
            v0 = developers.stats.by_version[0].acceptance
            online = settings.online.model_copy(update={
                "lr": 1e-3, "warmup_steps": 0, "kl_coef": 0.0, "min_batch": 32,
                "max_batch": 32})
            trainer = OnlineTrainer.restore(online, skilled, tmp_path / "trainer")
            inverted = [e.model_copy(update={"reward": -e.reward}) for e in read_all(
                kafka, kafka.topics.experiences, ExperienceReady)]
            for _ in range(3):  # three passes over v0's sessions, rewards negated
                for i in range(0, len(inverted) - 31, 32):
                    trainer.step(inverted[i:i + 32])
            candidate = trainer.export_candidate(settings.data_dir / "inverted.safetensors")
            trainer.close()
            r = http.post("/admin/releases", json={"candidate": str(candidate),
                                                   "reason": "inverted rewards"})
            assert r.status_code == 202, r.text
            version = r.json()["version"]
            decided = wait_for(lambda: ended(http, version), "the canary's decision", 240)
            status = replica_status(http)
            stop.set()
            thread.join(timeout=300)
    finally:
        join.stop()

    acceptance = decided["figures"]["acceptance"]
    print(f"\nv0 acceptance {v0:.2f}; canary {acceptance['candidate_mean']:.2f} "
          f"(n={acceptance['candidate_sessions']}) vs {acceptance['incumbent_mean']:.2f} "
          f"(n={acceptance['incumbent_sessions']}): {decided['status']}")
    assert decided["status"] == "rolled_back", decided
    assert (status["version"], status["swaps"]) == (0, 0)  # the incumbent never left
    assert developers.stats.failed_requests == 0
