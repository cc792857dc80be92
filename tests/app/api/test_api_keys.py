"""Inference keys and privacy mode on a running stack (keys required, as the production profile
has them): who may call /v1, as which user, how often, whose generations are logged; and the
admin API and CLI that manage keys."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import text

from app.api.api_keys import RECHECK_S
from app.cli.stack import RunningStack, running_stack
from app.db import make_db_engine
from ingest.broker import EmbeddedBroker
from tests.app.api.helpers import admin_client, wait_for_sessions
from tests.conftest import stack_settings

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


def private_chat(stack: RunningStack, key: str, **headers: str) -> httpx.Response:
    r = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "def secret_sauce():"}], "max_tokens": 4},
        headers={"Authorization": f"Bearer {key}", **headers})
    assert r.status_code == 200, r.text
    return r


def test_a_private_generation_is_served_counted_and_never_logged(
        stack: RunningStack, admin: httpx.Client) -> None:
    key = new_key(admin, "u-frank")
    asked = private_chat(stack, key, **{"X-Flywheel-Privacy": "on"})
    forced = private_chat(stack, new_key(admin, "u-grace", private=True),
                          **{"X-Flywheel-Privacy": "off"})  # a private key cannot be undone
    public = private_chat(stack, key)
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
    generation = private_chat(stack, key, **{"X-Flywheel-Privacy": "on"}).json()["id"]
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


def test_the_cli_makes_lists_and_revokes_keys(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}

    def flywheel(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "app.cli", "keys", *argv, "--data-dir",
                               str(tmp_path)], env=env, capture_output=True, text=True,
                              timeout=120)

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
