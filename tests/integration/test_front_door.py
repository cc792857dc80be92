"""The front door as a newcomer walks it: `flywheel demo` and `flywheel bootstrap` started in a
fresh working directory with the default, relative data dir (`data`), as `make demo` runs
them, on tiny budgets. Every other test hands the CLI an absolute temp dir; a relative one
once broke the rollout workers' policy store (`LocalArtifactStore.list`) and nothing saw it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

FLYWHEEL = Path(sys.executable).parent / "flywheel"

# small enough for the suite: a handful of everything the real run does many times
TINY = {"FLYWHEEL_BOOTSTRAP__ROLLOUT_WORKERS": "1", "FLYWHEEL_BOOTSTRAP__GROUPS_PER_STEP": "1",
        "FLYWHEEL_BOOTSTRAP__GROUP_SIZE": "2", "FLYWHEEL_BOOTSTRAP__EVAL_TASKS": "3",
        "FLYWHEEL_BOOTSTRAP__MIDTRAIN_BATCH": "2", "FLYWHEEL_RELEASE__EVAL__KIND": "held_out_tasks",
        "FLYWHEEL_RELEASE__EVAL__MAX_TASKS": "3",
        "FLYWHEEL_RELEASE__EVAL__SAMPLES_PER_TASK": "2"}


def tiny_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    return env | TINY | {"FLYWHEEL_ENGINE__COMPILE": "false"}


def flywheel(cwd: Path, *args: str, timeout: float = 600) -> tuple[dict[str, Any], str]:
    """Run the `flywheel` command of this venv in `cwd` with no --data-dir; its last stdout
    line (the JSON summary) and its whole output."""
    proc = subprocess.run([str(FLYWHEEL), *args], cwd=cwd, env=tiny_env(), capture_output=True,
                          text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), output


def test_demo_runs_from_a_fresh_directory_with_the_default_data_dir(tmp_path: Path) -> None:
    tiny_plan = ["--midtrain-steps", "4", "--grpo-steps", "1", "--releases", "1",
                 "--release-every-steps", "1", "--online-batch", "4", "--min-sessions", "4",
                 "--developers", "2", "--loop-seconds", "400",
                 # no canary: its test wants 30 sessions an arm, and an untrained model's
                 # arms are equal, which it rolls back up to a tenth of the time
                 "--canary-share", "0"]
    summary, _ = flywheel(tmp_path, "demo", *tiny_plan)
    data = tmp_path / "data"  # relative to where it ran, nowhere else
    assert (data / "bootstrap" / "model" / "config.json").exists()
    assert (data / "demo.png").exists()
    sessions = [json.loads(line) for line in
                (data / "live" / "sessions.jsonl").read_text().splitlines()]
    assert len(sessions) >= 4 and all(s["task_id"].startswith("builtin/") for s in sessions)
    assert not (data / "bootstrap" / "policy").exists()  # the run's policy store is removed
    assert summary["releases"] == 1 and summary["failed_requests"] == 0
    # a second run in the same directory reuses the bootstrap and starts live from version 0
    again, output = flywheel(tmp_path, "demo", *tiny_plan)
    assert "reusing the bootstrapped model" in output
    assert "removing the previous run's live state" in output
    assert again["releases"] == 1 and again["failed_requests"] == 0


def test_bootstrap_runs_from_a_fresh_directory_with_the_default_data_dir(
        tmp_path: Path) -> None:
    summary, _ = flywheel(tmp_path, "bootstrap", "--midtrain-steps", "2", "--max-steps", "1",
                          "--no-progress")
    assert summary["steps"] == 1
    (run_dir,) = (tmp_path / "data" / "runs").iterdir()
    assert (run_dir / "model" / "config.json").exists()
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 1
    assert (tmp_path / "data" / "models" / "base" / "config.json").exists()


def test_sigterm_stops_the_bootstrap_and_every_process_it_started(tmp_path: Path) -> None:
    """`kill` on a running bootstrap (or demo) takes its embedded broker and rollout workers
    down with it, as Ctrl-C does: nothing is left running behind it."""
    proc = subprocess.Popen([str(FLYWHEEL), "bootstrap", "--midtrain-steps", "1000000",
                             "--no-progress"], cwd=tmp_path, env=tiny_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        started = psutil.Process(proc.pid)
        deadline = time.monotonic() + 300
        children: list[psutil.Process] = []
        while time.monotonic() < deadline:  # the broker and a rollout worker, mid-training
            children = started.children(recursive=True)
            if any("tansu" in c.name() for c in children) and len(children) >= 2:
                break
            assert proc.poll() is None, "the bootstrap ended before it was stopped"
            time.sleep(1.0)
        assert len(children) >= 2, [c.name() for c in children]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        _, alive = psutil.wait_procs(children, timeout=60)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
