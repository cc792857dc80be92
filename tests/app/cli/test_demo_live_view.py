"""The demo as the operator of a held canary, against `flywheel up` with the canary on: a
release whose test cannot decide (its floor out of reach, its cap at 3 candidate sessions) is
held, and `LiveView.end_held` rolls it back, as `flywheel demo` does each time it looks:
decided by "demo", version 0 still served, nothing left to end."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from app.cli.demo_loop import DemoPlan, LiveView
from app.settings import Settings
from ingest.log import EventProducer
from tests.conftest import flywheel_up
from tests.integration.helpers import wait_for
from tests.trainer.helpers import make_checkpoint, make_experiences

pytestmark = pytest.mark.integration


def test_the_demo_rolls_back_a_held_canary(tmp_path: Path, model_dir: Path) -> None:
    data = tmp_path / "data"
    candidate = data / "checkpoints" / "candidate.safetensors"
    candidate.parent.mkdir(parents=True)
    make_checkpoint(model_dir, candidate, scale=1e-3, seed=5)
    env = {"FLYWHEEL_RELEASE__CANDIDATE_PATH": str(candidate),
           "FLYWHEEL_RELEASE__EVAL": json.dumps({"kind": "heldout_loss", "sequences": 2,
                                                 "seq_len": 64}),
           "FLYWHEEL_RELEASE__CANARY__ENABLED": "true",
           "FLYWHEEL_RELEASE__CANARY__MIN_SESSIONS": "1000",
           "FLYWHEEL_RELEASE__CANARY__MAX_SESSIONS": "3"}
    with flywheel_up(data, model_dir, **env) as (url, kafka):
        view = LiveView(url, Settings(data_dir=data).admin_secret().get_secret_value(),
                        DemoPlan())
        view.http.post("/admin/releases", json={"reason": "test"}).raise_for_status()
        wait_for(lambda: [c for c in view.canaries() if c["status"] == "running"],
                 "v1 in its canary", timeout_s=120)
        assert view.end_held() == []  # running, not held: left to its test

        topics = Settings().topics  # three sessions judged on each arm
        producer = EventProducer(Settings(topics=topics).kafka_config(kafka))
        now = datetime.now(UTC) + timedelta(seconds=1)
        for i, exp in enumerate(make_experiences(model_dir, 6, seed=9, max_tokens=3)):
            exp = exp.model_copy(update={
                "session_id": f"s-{i}", "turn": 0, "turns": 1, "model_version": i % 2,
                "feedback_kind": "accept", "reward": 1.0, "generated_at": now})
            producer.send(topics.experiences, exp.experience_id, exp)
        producer.flush(timeout_s=30)
        producer.close()
        wait_for(lambda: [c for c in view.canaries() if c["status"] == "held"],
                 "v1 held at its cap")

        assert view.end_held() == [
            "canary v1 held after 3 candidate sessions: the demo rolls it back"]
        canary = view.canaries()[-1]
        assert (canary["version"], canary["status"], canary["decided_by"]) == (
            1, "rolled_back", "demo")
        assert view.http.get("/admin/releases/1").json()["status"] == "rolled_back"
        assert view.http.get("/admin/status").json()["model_version"] == 0
        assert view.end_held() == []
