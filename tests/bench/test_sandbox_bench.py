"""bench/sandbox.py runs both launches to a passing job and ends with its JSON line (the
baseline also keeps `sandbox_child.py`'s direct, one-job mode working)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "sandbox.py"


def test_both_launches_pass_the_job_and_the_json_line_has_the_figures(
        capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_sandbox", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--jobs", "2"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["bench"] == "sandbox" and line["jobs"] == 2
    assert {"fresh_cpu_ms", "zygote_cpu_ms", "cpu_ratio"} <= set(line)
