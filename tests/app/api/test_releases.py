"""The release admin API: bearer token required, 404/409 with reasons, 202 with a version."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from app.api.main import create_app
from app.settings import Settings
from tests.trainer.helpers import make_checkpoint


def test_release_routes_need_the_token_and_answer_with_reasons(settings: Settings,
                                                               model_dir: Path) -> None:
    gate = settings.release.eval.model_copy(update={"max_tasks": 8, "samples_per_task": 2})
    settings = settings.model_copy(update={"release": settings.release.model_copy(
        update={"follow": False, "eval": gate})})
    admin = {"Authorization": f"Bearer {settings.admin_secret().get_secret_value()}"}
    with TestClient(create_app(settings)) as http:
        assert http.get("/admin/releases").status_code == 401
        assert http.post("/admin/releases", headers={"Authorization": "Bearer x"}
                         ).status_code == 401
        assert http.get("/admin/releases", headers=admin).json() == []
        r = http.get("/admin/releases/3", headers=admin)
        assert r.status_code == 404 and "v3" in r.text
        r = http.post("/admin/releases", headers=admin, json={"reason": "test"})
        assert r.status_code == 404 and "no candidate checkpoint" in r.text  # none written yet
        settings.resolved_candidate_path.parent.mkdir(parents=True)
        make_checkpoint(model_dir, settings.resolved_candidate_path, scale=1e-3, seed=1)
        r = http.post("/admin/releases", headers=admin, json={"reason": "test"})
        assert r.status_code == 202, r.text
        assert r.json()["version"] == 1 and r.json()["task_id"]
        row = http.get("/admin/releases/1", headers=admin).json()
        assert (row["status"], row["reason"]) == ("candidate", "test")
        r = http.post("/admin/releases/1/rollback", headers=admin)
        assert r.status_code == 409 and "head" in r.text
