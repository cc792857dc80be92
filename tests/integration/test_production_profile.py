"""The production profile against real PostgreSQL and Redis (skipped without them; CI fails).

PostgreSQL holds the SQL state through the same code path as SQLite; Redis carries Celery
tasks to a real worker.
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from sqlalchemy import text

from app.cli.stack import running_stack
from app.settings import Settings
from ingest.config import KafkaConfig
from ingest.signing import SIGNATURE_HEADER, sign
from tests.conftest import POSTGRES_URL, require_service

pytestmark = pytest.mark.integration
REDIS_URL = "redis://127.0.0.1:6379/0"
SECRET = "production-webhook-secret"


@pytest.fixture
def postgres_url() -> str:
    require_service("PostgreSQL", "127.0.0.1", 5432)
    return POSTGRES_URL


def test_app_runs_on_postgres(postgres_url: str, kafka: KafkaConfig, tmp_path,
                              model_dir) -> None:
    settings = Settings(profile="production", kafka_bootstrap=kafka.bootstrap,
                        topics=kafka.topics, database_url=postgres_url, data_dir=tmp_path,
                        model_dir=model_dir, port=0, feedback_secrets=[SECRET],
                        admin_token="an operator's own")
    event_id = f"pg-{uuid.uuid4().hex}"
    body = json.dumps({"event_id": event_id, "generation_id": "g", "kind": "thumbs_up"}).encode()
    with running_stack(settings) as stack, httpx.Client(base_url=stack.base_url) as http:
        unsigned = http.post("/v1/feedback", content=body,
                             headers={"content-type": "application/json"})
        assert unsigned.status_code == 401, unsigned.text
        r = http.post("/v1/feedback", content=body, headers={
            "content-type": "application/json", SIGNATURE_HEADER: sign(SECRET, None, body)})
        assert r.status_code == 202, r.text
        # inference keys are required, kept in PostgreSQL
        assert http.get("/v1/models").status_code == 401
        made = http.post("/admin/keys", json={"user_id": "u-pg"},
                         headers={"Authorization": "Bearer an operator's own"})
        assert made.status_code == 201, made.text
        key = made.json()["key"]
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}
                        ).status_code == 200
    from sqlalchemy import create_engine

    engine = create_engine(postgres_url)
    with engine.connect() as conn:
        row = conn.execute(text("select kind from feedbackreceipt where event_id = :e"),
                           {"e": event_id}).one()
    engine.dispose()
    assert row.kind == "thumbs_up"
