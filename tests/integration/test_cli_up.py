"""`flywheel up --port P --data-dir D`: serves on 127.0.0.1:P, prints READY, state under D."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ingest.broker import free_port

pytestmark = pytest.mark.integration


def test_help_does_not_import_torch() -> None:
    code = ("import sys; from app.cli import build_parser; build_parser().format_help(); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_up_prints_ready_and_keeps_state_under_data_dir(tmp_path: Path,
                                                        model_dir: Path) -> None:
    port = free_port()
    data = tmp_path / "state"
    env = {**os.environ, "FLYWHEEL_MODEL_DIR": str(model_dir)}
    env.pop("FLYWHEEL_KAFKA_BOOTSTRAP", None)
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "up", "--port", str(port),
                             "--data-dir", str(data)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline() if proc.stdout else ""
            if line.startswith("READY") or proc.poll() is not None:
                break
        assert line.strip() == f"READY http://127.0.0.1:{port}"
        health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).json()
        assert health["status"] == "ok"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0
    assert (data / "flywheel.db").exists()
    assert (data / "broker.log").exists()
