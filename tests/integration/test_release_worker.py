"""`flywheel up` runs its own release worker (embedded profile): a release triggered through
`POST /admin/releases` is built and published with no separate `celery worker`, and beat
triggers one every `release.interval_s`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import flywheel_up
from tests.trainer.helpers import make_checkpoint

pytestmark = pytest.mark.integration
TOKEN = "release-worker-test-token"


def wait_for_release(http: httpx.Client, what: str, predicate: Any,
                     timeout_s: float = 240.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for row in http.get("/admin/releases").json():
            if predicate(row):
                return row  # type: ignore[no-any-return]
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}: {http.get('/admin/releases').json()}")


def test_flywheel_up_builds_admin_and_beat_releases(tmp_path: Path, model_dir: Path) -> None:
    ckpt = tmp_path / "ckpt.safetensors"
    make_checkpoint(model_dir, ckpt, scale=1e-3, seed=11)
    env = {"FLYWHEEL_ADMIN_TOKEN": TOKEN, "FLYWHEEL_RELEASE__CANDIDATE_PATH": str(ckpt),
           "FLYWHEEL_RELEASE__INTERVAL_S": "20",
           "FLYWHEEL_RELEASE__EVAL": '{"kind": "heldout_loss", "sequences": 2, "seq_len": 64}'}
    with flywheel_up(tmp_path / "state", model_dir, **env) as (url, _), httpx.Client(
            base_url=url, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        r = http.post("/admin/releases", json={"reason": "admin trigger"})
        assert r.status_code == 202, r.text
        version = r.json()["version"]
        row = wait_for_release(http, f"v{version} published",
                               lambda row: row["version"] == version
                               and row["status"] != "candidate")
        assert (row["status"], row["requested_by"]) == ("published", "admin"), row
        replica = wait_for_release(  # the app's replica swaps to it as well
            http, "the replica", lambda _: http.get("/admin/status").json()["replica"]
            ["version"] == version)
        assert replica
        beat = wait_for_release(http, "a beat release",
                                lambda row: row["requested_by"] == "beat"
                                and row["status"] != "candidate")
        assert beat["status"] == "published" and beat["version"] > version, beat
