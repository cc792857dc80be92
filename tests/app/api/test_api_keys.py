"""Inference keys, privacy mode and deletion on a running stack (keys required, as the
production profile has them): who may call /v1, as which user, how often, whose generations are
logged, whose data the trainer may use; and the admin API and CLI that manage keys and
deletions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import text

from app.api.api_keys import RECHECK_S
from app.cli.stack import RunningStack, running_stack
from app.db import make_db_engine
from ingest.broker import EmbeddedBroker
from ingest.config import JoinSettings
from ingest.deletions import Forgotten, open_deletions_db
from ingest.join import Join
from ingest.log import ensure_topics
from tests.app.api.helpers import admin_client, wait_for_sessions
from tests.conftest import stack_settings
from tests.ingest.helpers import run_until
from trainer.online.intake import experience_source
from trainer.online.loop import OnlineLoop
from trainer.online.trainer import OnlineTrainer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(broker: EmbeddedBroker, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[RunningStack]:
    settings = stack_settings(broker, model_dir, tmp_path_factory.mktemp("keys"),
                              require_api_keys=True, engine={"max_new_tokens_cap": 8})
    with running_stack(settings) as running:
        yield running


@pytest.fixture
def admin(stack: RunningStack) -> Iterator[httpx.Client]:
    with admin_client(stack) as client:
        yield client


def new_key(admin: httpx.Client, user_id: str, **extra: object) -> str:
    r = admin.post("/admin/keys", json={"user_id": user_id, **extra})
    assert r.status_code == 201, r.text
    return str(r.json()["key"])


def models(stack: RunningStack, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.get(f"{stack.base_url}/v1/models", headers=headers, timeout=30)


def test_v1_takes_no_caller_without_a_valid_key(stack: RunningStack,
                                                admin: httpx.Client) -> None:
    key = new_key(admin, "u-valid")
    for wrong in (None, "nonsense", key[:-2], key.replace("fwk-", "fwk-0"),
                  admin.headers["Authorization"].removeprefix("Bearer ")):  # not the admin's
        r = models(stack, wrong)
        assert r.status_code == 401, (wrong, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401
    assert models(stack, key).status_code == 200
    assert httpx.get(f"{stack.base_url}/healthz", timeout=30).status_code == 200


def test_the_keys_user_is_the_logged_one_whatever_the_body_says(
        stack: RunningStack, admin: httpx.Client) -> None:
    key = new_key(admin, "u-alice")
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0)
    reply = client.chat.completions.create(
        model="flywheel", messages=[{"role": "user", "content": "def add(a, b):"}],
        max_tokens=4, user="u-mallory")
    logged = wait_for_sessions(stack.kafka, {reply.id})
    assert logged[reply.id].user_id == "u-alice"


def test_a_revoked_key_is_refused_within_a_second(stack: RunningStack,
                                                  admin: httpx.Client) -> None:
    key = new_key(admin, "u-bob")
    key_id = key.removeprefix("fwk-").split(".")[0]
    assert models(stack, key).status_code == 200  # read, and remembered for RECHECK_S
    revoked = admin.delete(f"/admin/keys/{key_id}")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    time.sleep(RECHECK_S)
    r = models(stack, key)
    assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]
    assert admin.delete("/admin/keys/no-such-key").status_code == 404


def test_a_rate_limit_answers_429_with_retry_after(stack: RunningStack,
                                                   admin: httpx.Client) -> None:
    key = new_key(admin, "u-carol", rps=0.2)  # one request, then one per 5 s
    assert models(stack, key).status_code == 200
    r = models(stack, key)
    assert r.status_code == 429, r.text
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(r.headers["retry-after"]) <= 5
    assert models(stack, new_key(admin, "u-dave")).status_code == 200  # per key


def test_keys_are_listed_without_secrets_and_stored_as_hashes(
        stack: RunningStack, admin: httpx.Client) -> None:
    key = new_key(admin, "u-erin", label="laptop")
    secret = key.split(".", 1)[1]
    listed = admin.get("/admin/keys")
    assert listed.status_code == 200
    assert secret not in listed.text and "secret" not in listed.text
    assert any(k["user_id"] == "u-erin" and k["label"] == "laptop" for k in listed.json())
    engine = make_db_engine(stack.settings.resolved_database_url)
    try:
        with engine.connect() as db:
            rows = db.execute(text("select * from api_key")).all()
    finally:
        engine.dispose()
    assert rows and all(secret not in str(row) for row in rows)
    assert httpx.get(f"{stack.base_url}/admin/keys", timeout=30).status_code == 401
    bad = admin.post("/admin/keys", json={"user_id": "u", "rps": 0})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "rps"


def chat_as(stack: RunningStack, key: str, **headers: str) -> httpx.Response:
    r = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "def secret_sauce():"}], "max_tokens": 4},
        headers={"Authorization": f"Bearer {key}", **headers})
    assert r.status_code == 200, r.text
    return r


def test_a_private_generation_is_served_counted_and_never_logged(
        stack: RunningStack, admin: httpx.Client) -> None:
    key = new_key(admin, "u-frank")
    asked = chat_as(stack, key, **{"X-Flywheel-Privacy": "on"})
    forced = chat_as(stack, new_key(admin, "u-grace", private=True),
                          **{"X-Flywheel-Privacy": "off"})  # a private key cannot be undone
    public = chat_as(stack, key)
    private_ids = {asked.json()["id"], forced.json()["id"]}
    assert all(i.startswith("genp-") for i in private_ids)
    assert asked.json()["choices"][0]["message"]["content"] is not None  # served all the same
    logged = wait_for_sessions(stack.kafka, {public.json()["id"]})  # the log has flushed
    assert public.json()["id"] in logged
    assert not private_ids & set(logged)
    private_requests = {asked.headers["x-request-id"], forced.headers["x-request-id"]}
    assert not {e.request_id for e in logged.values()} & private_requests
    figures = admin.get("/admin/console").json()["private"]
    assert figures["private"] >= 2 and figures["generations"] >= 3
    assert "flywheel_private_generations_total" in httpx.get(f"{stack.base_url}/metrics").text

    bad = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {key}", "X-Flywheel-Privacy": "maybe"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Flywheel-Privacy"


def test_feedback_about_a_private_generation_is_refused_and_counted(
        stack: RunningStack, admin: httpx.Client) -> None:
    key = new_key(admin, "u-heidi")
    generation = chat_as(stack, key, **{"X-Flywheel-Privacy": "on"}).json()["id"]
    r = httpx.post(f"{stack.base_url}/v1/feedback", timeout=30, json={
        "event_id": "fb-private", "generation_id": generation, "kind": "accept"})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "private_generation"
    batch = httpx.post(f"{stack.base_url}/v1/feedback/batch", timeout=30, json={"events": [
        {"event_id": "fb-1", "generation_id": "gen-x", "kind": "accept"},
        {"event_id": "fb-2", "generation_id": generation, "kind": "reject"}]})
    assert batch.status_code == 422 and batch.json()["error"]["param"] == "events.1.generation_id"
    metrics = httpx.get(f"{stack.base_url}/metrics", timeout=30).text
    assert 'flywheel_feedback_rejected_total{reason="private_generation"} 2.0' in metrics


def cli(command: str, data_dir: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """`flywheel COMMAND ARGV… --data-dir D` in a process of its own, with no FLYWHEEL_*
    setting from this environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}

    def flywheel(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "app.cli", command, *argv, "--data-dir",
                               str(data_dir)], env=env, capture_output=True, text=True,
                              timeout=120)

    return flywheel


def test_the_cli_makes_lists_and_revokes_keys(tmp_path: Path) -> None:
    flywheel = cli("keys", tmp_path)
    made = flywheel("create", "--user", "u-cli", "--rps", "2")
    assert made.returncode == 0, made.stderr
    key = made.stdout.split()[0]
    assert key.startswith("fwk-")
    key_id = key.removeprefix("fwk-").split(".")[0]
    listed = flywheel("list")
    assert f"{key_id}  user=u-cli  2 rps  active" in listed.stdout
    assert key.split(".", 1)[1] not in listed.stdout
    assert flywheel("revoke", key_id).returncode == 0
    assert "revoked" in flywheel("list").stdout
    gone = flywheel("revoke", "nope")
    assert gone.returncode == 1 and "no key nope" in gone.stderr
    refused = flywheel("create", "--user", "u-cli", "--rps", "0")
    assert refused.returncode == 2 and "rps" in refused.stderr


def test_a_deleted_users_untrained_data_never_reaches_the_trainers_ledger(
        stack: RunningStack, admin: httpx.Client, model_dir: Path) -> None:
    """Alice and Bob generate and give feedback; the join makes experiences of both; Alice is
    deleted; the real trainer then trains on Bob's and on what Alice did after, never on what
    she did before, though it was on `experiences` already."""
    kafka = stack.kafka.model_copy(update={"topics": stack.kafka.topics.model_copy(
        update={"experiences": f"experiences-{uuid.uuid4().hex[:8]}"})})
    ensure_topics(kafka)
    alice, bob = new_key(admin, "u-deleted"), new_key(admin, "u-kept")
    before, untouched, kept = chat_as(stack, alice), chat_as(stack, alice), \
        chat_as(stack, bob)
    ids = [r.json()["id"] for r in (before, untouched, kept)]

    def accept(generation_id: str) -> None:
        r = httpx.post(f"{stack.base_url}/v1/feedback", timeout=30, json={
            "event_id": f"fb-{generation_id}", "generation_id": generation_id,
            "kind": "accept"})
        assert r.status_code in (200, 202), r.text

    accept(ids[0])
    accept(ids[2])
    wait_for_sessions(kafka, set(ids))
    settings = stack.settings
    join = Join(kafka, JoinSettings(group_id=f"join-{uuid.uuid4().hex[:8]}", poll_timeout_ms=100),
                database_url=settings.resolved_join_database_url)
    try:
        run_until(join, lambda: join.stats.experiences == 2)  # on the topic, not trained yet
        r = admin.post("/admin/deletions", json={"user_id": "u-deleted", "reason": "test"})
        assert r.status_code == 201, r.text
        assert (r.json()["sessions"], r.json()["requested_by"]) == (2, "admin")
        assert r.json()["completed_at"] is not None
        accept(ids[1])  # about a deleted generation: never joined
        after = chat_as(stack, alice).json()["id"]  # she goes on: new data
        accept(after)
        wait_for_sessions(kafka, {after})
        run_until(join, lambda: join.stats.experiences == 3)
    finally:
        join.close()
    assert [d["user_id"] for d in admin.get("/admin/deletions").json()][:1] == ["u-deleted"]
    assert httpx.get(f"{stack.base_url}/admin/deletions", timeout=30).status_code == 401

    cfg = settings.online.model_copy(update={"min_batch": 1, "max_batch": 4,
                                             "deterministic": True, "stop_after": 2})
    root = settings.data_dir / "deletion-trainer"
    trainer = OnlineTrainer.restore(cfg, model_dir, root)
    source = experience_source(kafka, group_id=f"t-{uuid.uuid4().hex[:8]}", dlq=None)
    deletions = open_deletions_db(settings.resolved_database_url)
    stop = threading.Event()
    timer = threading.Timer(180, stop.set)
    timer.start()
    try:
        loop = OnlineLoop(trainer, source, candidate_dir=root / "candidates",
                          forgotten=Forgotten(deletions))
        report = loop.run(stop)
    finally:
        timer.cancel()
        source.close()
        trainer.close()
        deletions.dispose()
    trained = {g for entry in trainer.ledger.between(0, trainer.state.step)
               for g in entry.generation_ids}
    assert trained == {ids[2], after}, report
    assert report.forgotten == 1


def test_the_cli_deletes_a_user_and_lists_deletions(tmp_path: Path) -> None:
    flywheel = cli("users", tmp_path)
    done = flywheel("delete", "u-cli", "--reason", "asked by mail")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert (record["user_id"], record["requested_by"], record["sessions"]) == ("u-cli", "cli", 0)
    listed = flywheel("deletions")
    assert f"{record['id']}  user=u-cli" in listed.stdout and "asked by mail" in listed.stdout
    refused = flywheel("delete", "")
    assert refused.returncode == 2 and "user_id" in refused.stderr
