"""What a bootstrap run leaves in its run dir besides the trackers' files: a metrics line per
step, each held-out task's outcome before and after, the kept version's weights, a plot."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from simulate.rollouts import TaskOutcome
from trainer.policy import Policy


@dataclass(frozen=True)
class KeptVersion:
    """A policy version the bootstrap may end on: the GRPO step that made it, its validation
    pass@1, and its whole weights in the served dtype (a copy on the CPU)."""

    step: int
    version: int
    score: float
    weights: dict[str, torch.Tensor] = field(repr=False)


def append_metrics(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def write_outcomes(path: Path, before: list[TaskOutcome],
                   after: list[TaskOutcome]) -> dict[str, int]:
    """Each held-out task's greedy outcome and final solution at the mid-trained start and at
    the end, one JSON line per task; returns how many GRPO fixed, broke, or left failing."""
    changes = {"fixed": 0, "broken": 0, "still_failing": 0}
    with path.open("w") as f:
        for b, a in zip(before, after, strict=True):
            changes["fixed"] += a.passed and not b.passed
            changes["broken"] += b.passed and not a.passed
            changes["still_failing"] += not (a.passed or b.passed)
            f.write(json.dumps({"task_id": a.task_id, "passed_before": b.passed,
                                "passed_after": a.passed, "solution_before": b.solution,
                                "solution_after": a.solution}) + "\n")
    return changes


def write_final_outcomes(path: Path, outcomes: list[TaskOutcome]) -> None:
    """Each task's greedy outcome and final solution at the kept version, one JSON line each."""
    with path.open("w") as f:
        for o in outcomes:
            f.write(json.dumps({"task_id": o.task_id, "passed": o.passed,
                                "solution": o.solution}) + "\n")


def save_version(policy: Policy, kept: KeptVersion, out_dir: Path) -> Path:
    """The kept version's weights and the tokenizer as a Hugging Face model directory (the
    policy's own save when it is the current version)."""
    if kept.version == policy.version:
        return policy.save(out_dir)
    model = policy.unsharded_model()  # the model's shape in the served dtype, on the leader
    model.load_state_dict(kept.weights)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    policy.tokenizer.save_pretrained(out_dir)
    return out_dir


def plot_run(history: list[dict[str, float]], evals: list[tuple[int, float]],
             held_out: tuple[float, float, int], path: Path) -> Path:
    """Rollout reward and solved rate per step, validation pass@1 at each evaluation, and
    held-out pass@1 (before, after, kept step) at the start and at the kept version."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [h["step"] for h in history]
    ax.plot(steps, [h["reward"] for h in history], label="rollout reward", alpha=0.6)
    ax.plot(steps, [h["solved"] for h in history], label="rollouts solved", alpha=0.6)
    ax.plot([s for s, _ in evals], [p for _, p in evals], "o-",
            label="validation pass@1")
    before, after, kept_step = held_out
    ax.plot([0, kept_step], [before, after], "s", markersize=8, label="held-out pass@1")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(-0.02, 1.02)
    ax.legend()
    ax.set_title("flywheel bootstrap")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
