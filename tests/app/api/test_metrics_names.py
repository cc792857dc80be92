"""Prometheus names: what a running app exposes at `/metrics` follows the conventions (one
`flywheel_` prefix, `_total` on counters, base units, no per-user or per-session labels), and
every metric deploy/grafana/flywheel.json queries is among them, the online trainer's step
metrics included (published by a real trainer step into the status row the API reads), after
one real completion (a labelled metric has no sample before its first observation)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.cli.stack import running_stack
from app.settings import Settings
from tests.trainer.helpers import make_experiences
from trainer.online.config import OnlineTrainerSettings
from trainer.online.control import SqlTrainerControl, open_control_db
from trainer.online.trainer import OnlineTrainer

pytestmark = pytest.mark.integration
DASHBOARD = Path(__file__).parents[3] / "deploy" / "grafana" / "flywheel.json"
FORBIDDEN_LABELS = {"user", "user_id", "session", "session_id", "generation_id", "event_id"}
UNIT_WORDS = ("_ms", "_milliseconds", "_kb", "_mb", "_minutes", "_hours")


def dashboard_metrics() -> set[str]:
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"]
             for t in p["targets"]]
    return {name for e in exprs for name in re.findall(r"\bflywheel_[a-z0-9_]+", e)}


def test_grafana_queries_only_metrics_the_app_exposes(settings: Settings, tmp_path: Path,
                                                      model_dir: Path) -> None:
    trainer = OnlineTrainer.restore(OnlineTrainerSettings(min_batch=4, max_batch=4),
                                    model_dir, tmp_path / "trainer")
    step = trainer.step(make_experiences(model_dir, 4, seed=1, max_tokens=3))
    trainer.close()
    with running_stack(settings) as stack:
        control = SqlTrainerControl(open_control_db(stack.settings.resolved_database_url))
        control.publish(step=1, consumed=4, lag=0, paused=False, metrics=step)
        reply = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        deadline = time.monotonic() + 30  # the join's lag is read by a thread of its own
        while True:
            text = httpx.get(f"{stack.base_url}/metrics", timeout=30).text
            families = list(text_string_to_metric_families(text))
            samples = {s.name for f in families for s in f.samples}
            missing = dashboard_metrics() - samples
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert not missing, f"the dashboard queries metrics /metrics lacks: {sorted(missing)}"
    for family in families:
        assert family.name.startswith("flywheel_"), family.name
        assert not family.name.endswith(UNIT_WORDS), family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)
        labels = {k for s in family.samples for k in s.labels}
        assert not labels & FORBIDDEN_LABELS, (family.name, labels)
