"""`flywheel bootstrap --nproc 2`: the whole bootstrap with its learner sharded on 2 gloo ranks.

Tiny budgets (3 mid-training steps, 3 GRPO steps, 4 held-out tasks) on the default model: the
wiring is what is checked (every collective phase the leader enters, rollout engines and the
eval engine built from the sharded policy, the model saved whole by the leader), not learning;
that a sharded step is the one process's is tests/trainer/test_distributed.py's.

    python -m pytest tests/integration/test_bootstrap_sharded.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.release.weights import base_weights

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_bootstrap_on_two_ranks_runs_end_to_end(model_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "FLYWHEEL_MODEL_DIR": str(model_dir),
           "FLYWHEEL_BOOTSTRAP": json.dumps({
               "eval_tasks": 4, "group_size": 2, "groups_per_step": 2, "max_tokens": 8,
               "max_turns": 1, "midtrain_batch": 4})}
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "app.cli", "bootstrap", "--nproc", "2", "--max-steps", "3",
         "--midtrain-steps", "3", "--time-budget-s", "120", "--no-progress",
         "--run-dir", str(run_dir), "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and 0.0 <= summary["pass_at_1_after"] <= 1.0
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    saved, base = base_weights(run_dir / "model"), base_weights(model_dir)
    assert saved.keys() == base.keys()
    assert any(not torch.equal(saved[n], base[n]) for n in base), "mid-training moved nothing"
