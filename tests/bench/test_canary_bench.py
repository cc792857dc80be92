"""bench/canary.py runs its two simulated candidates to decisions and ends with its JSON line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "canary.py"


def test_the_json_line_has_both_candidates_figures(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_canary", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--trials", "20", "--share", "0.5"])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["bench"] == "canary" and line["trials"] == 20
    assert line["sessions_to_rollback_worse_10"] > 0 and line["sessions_to_promote_equal"] > 0
    assert line["fixed_horizon_sessions"] > 0 and line["held_rate"] == 0.0
