"""`flywheel up --port P --data-dir D`: serves on 127.0.0.1:P, prints READY with the URL and
the Kafka address, keeps its state under D."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from app.settings import Settings
from tests.conftest import flywheel_up

pytestmark = pytest.mark.integration


def test_help_does_not_import_torch() -> None:
    code = ("import sys; from app.cli.main import build_parser; build_parser().format_help(); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_up_prints_ready_and_keeps_state_under_data_dir(tmp_path: Path,
                                                        model_dir: Path) -> None:
    data = tmp_path / "state"
    with flywheel_up(data, model_dir) as (url, kafka):
        assert httpx.get(f"{url}/healthz", timeout=10).json()["status"] == "ok"
        token = Settings(data_dir=data).admin_secret().get_secret_value()
        status = httpx.get(f"{url}/admin/status", timeout=10,
                           headers={"Authorization": f"Bearer {token}"}).json()
        assert status["kafka_bootstrap"] == kafka  # the address READY printed
    assert (data / "flywheel.db").exists()
    assert (data / "broker.log").exists()
