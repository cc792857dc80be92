"""A short end-to-end bootstrap on the real tiny model: artefacts and the final JSON line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from app.cli.main import main


def test_bootstrap_smoke_writes_run_dir_and_json_line(
        model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    for key, value in {"GROUP_SIZE": "2", "GROUPS_PER_STEP": "1", "EVAL_TASKS": "3",
                       "EVAL_EVERY": "1", "MAX_TOKENS": "8", "MAX_TURNS": "2",
                       "MIDTRAIN_BATCH": "2"}.items():
        monkeypatch.setenv(f"FLYWHEEL_BOOTSTRAP__{key}", value)
    monkeypatch.setenv("FLYWHEEL_MODEL_DIR", str(model_dir))
    run_dir = tmp_path / "run"
    code = main(["bootstrap", "--data-dir", str(tmp_path / "data"), "--run-dir", str(run_dir),
                 "--max-steps", "2", "--midtrain-steps", "2", "--no-progress"])
    assert code == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    assert set(summary) == {"pass_at_1_before", "pass_at_1_after", "family_pass_at_1_after",
                            "steps", "cheating_flagged",
                            "turns_per_episode", "summaries_per_episode", "tokens_per_window",
                            "ended_by_context", "wall_s"}
    # the unseen templates' tasks, scored like the held-out ones (3 of them here)
    assert 0.0 <= summary["family_pass_at_1_after"] <= 1.0
    assert 1 <= summary["turns_per_episode"] <= 3 and summary["tokens_per_window"] > 0
    assert summary["steps"] == 2 and 0.0 <= summary["pass_at_1_after"] <= 1.0
    assert (run_dir / "reward.png").stat().st_size > 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and "validation_pass_at_1" in rows[-1]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))  # trackers' default
    events.Reload()
    assert [e.value for e in events.Scalars("flywheel_bootstrap_reward")] == pytest.approx(
        [r["reward"] for r in rows])
    details = json.loads((run_dir / "summary.json").read_text())
    assert details["steps"] == 2 and (run_dir / "model" / "config.json").exists()
    assert details["family_tasks"] == 3
    family = (run_dir / "held_out_family.jsonl").read_text().splitlines()
    assert len(family) == 3 and sum(json.loads(r)["passed"] for r in family) / 3 \
        == summary["family_pass_at_1_after"]
    # scored at the start and at both steps; the best (the latest on a tie) is the one kept
    scores = [score for _, score in details["validation_evals"]]
    assert [step for step, _ in details["validation_evals"]] == [0, 1, 2]
    assert details["kept_validation_pass_at_1"] == max(scores)
    assert details["kept_step"] == scores.index(max(scores))  # the first of the best
    held_out = [json.loads(line) for line in (run_dir / "held_out.jsonl").read_text().splitlines()]
    assert len(held_out) == 3 and all(r["task_id"].startswith("builtin/") for r in held_out)
    assert all("def " in r["solution_before"] and "def " in r["solution_after"] for r in held_out)
    assert sum(r["passed_before"] for r in held_out) / 3 == summary["pass_at_1_before"]
    assert sum(details["held_out_changes"].values()) <= 3


def test_mean_reward_is_the_seeded_expected_reward_on_a_fixed_task_list(model_dir: Path) -> None:
    """What bench/vs_trl.py compares final policies by: the same tasks and seeds give the
    same figure, and every episode's reward is counted."""
    from simulate.rollouts import SandboxCache
    from simulate.tasks import BuiltinTaskSource
    from trainer.bootstrap.config import BootstrapSettings
    from trainer.bootstrap.local_engine import mean_reward
    from trainer.policy import Policy

    cfg = BootstrapSettings(max_tokens=8, max_turns=2)
    policy = Policy.load(model_dir, lr=cfg.lr)
    tasks = BuiltinTaskSource(0.2).split("train")[:2]
    cache = SandboxCache()
    first = mean_reward(policy, cfg, tasks, samples=2, cache=cache)
    assert 0.0 <= first <= 1.0 and cache.misses + cache.hits >= 4  # every episode scored
    assert mean_reward(policy, cfg, tasks, samples=2, cache=SandboxCache()) == first


def test_clip_anchor_behavior_makes_the_clip_bound_a_stale_batch(model_dir: Path) -> None:
    """Anchored at the trainer, a batch sampled several versions ago has ratio 1 and is never
    clipped (only IS-weighted); anchored at its behavior logprobs, the clip sees how far the
    policy has moved since."""
    from ingest.events import PackedArray
    from ingest.rollout_events import RolloutGroup, RolloutTrajectory
    from trainer.bootstrap.config import BootstrapSettings
    from trainer.bootstrap.run import OfflineTrainer
    from trainer.policy import Policy

    policy = Policy.load(model_dir, lr=1e-2)
    tokens, mask = [[5, 9, 14, 22, 31, 40], [5, 9, 17, 25, 33, 41]], [0, 0, 1, 1, 1, 1]
    batch = policy.batch(tokens, [mask, mask])
    with torch.no_grad():
        behavior = policy.token_logprobs(batch).tolist()  # version 0
    group = RolloutGroup(group_id="g", task_id="t", policy_version=0, trajectories=[
        RolloutTrajectory(token_ids=PackedArray.pack(ids, "int32"),
                          loss_mask=PackedArray.pack(mask, "uint8"),
                          logprobs=PackedArray.pack(logp, "float32"),
                          segment_lengths=PackedArray.pack([len(ids)], "int32"),
                          reward=reward, turns=1, finished=True)
        for ids, logp, reward in zip(tokens, behavior, [1.0, 0.0], strict=True)])
    for _ in range(5):  # move the policy: the group is now 5 versions stale
        (-(policy.token_logprobs(batch)[0] * batch.loss_mask[0]).sum()).backward()
        policy.optimizer_step()

    by_anchor = {}
    for anchor in ("trainer", "behavior"):
        cfg = BootstrapSettings(clip_anchor=anchor)
        # metrics are taken before the update: each anchor from the same stale policy
        by_anchor[anchor] = OfflineTrainer.from_settings(copy.deepcopy(policy), cfg).step([group])
    trainer, behavior_anchored = by_anchor["trainer"], by_anchor["behavior"]
    assert trainer["ratio_mean"] == pytest.approx(1.0) and trainer["clip_fraction"] == 0.0
    assert trainer["is_weight_mean"] != pytest.approx(1.0)
    assert behavior_anchored["clip_fraction"] > 0.0 and behavior_anchored["is_weight_mean"] == 1.0
    assert behavior_anchored["ratio_mean"] != pytest.approx(1.0)


def test_behavior_anchor_needs_an_is_cap_above_one() -> None:
    from trainer.bootstrap.config import BootstrapSettings

    with pytest.raises(ValueError, match="is_cap must be > 1 with clip_anchor 'behavior'"):
        BootstrapSettings(is_cap=1.0)
    assert BootstrapSettings(is_cap=1.0, clip_anchor="trainer").is_cap == 1.0


def test_the_kept_version_is_what_the_bootstrap_saves(model_dir: Path, tmp_path: Path) -> None:
    """A run keeps its best-scoring version (the earliest on a tie, none unless asked) and
    `save_version` writes that version, not the policy's current weights."""
    from transformers import AutoModelForCausalLM

    from simulate.rollouts import TaskOutcome
    from trainer.bootstrap.artifacts import KeptVersion, save_version
    from trainer.bootstrap.run import GrpoRun
    from trainer.policy import Policy

    def outcomes(passed: int) -> list[TaskOutcome]:
        return [TaskOutcome(f"t{i}", i < passed, "") for i in range(4)]

    policy = Policy.load(model_dir, lr=1e-2)
    start = policy.state_dict()
    run = GrpoRun(keep_best=True)
    assert run.add_eval(outcomes(2), policy.version, start) == 0.5
    batch = policy.batch([[5, 9, 14, 22, 31, 40]], [[0, 0, 1, 1, 1, 1]])
    (-(policy.token_logprobs(batch) * batch.loss_mask).sum()).backward()
    policy.optimizer_step()
    run.steps = 1
    run.add_eval(outcomes(1), policy.version, policy.state_dict())  # worse: the start stays
    assert run.best is not None and (run.best.step, run.best.version) == (0, 0)
    assert GrpoRun().add_eval(outcomes(4), 0, start) == 1.0 and GrpoRun().best is None

    def saved(kept: KeptVersion, name: str) -> dict[str, torch.Tensor]:
        out = save_version(policy, kept, tmp_path / name)
        return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()

    kept = saved(run.best, "kept")
    assert set(kept) == set(start) and all(torch.equal(kept[n], start[n]) for n in kept)
    now = policy.state_dict()
    assert any(not torch.equal(kept[n], now[n]) for n in kept)

    run.steps = 2
    run.add_eval(outcomes(2), policy.version, now)  # a tie: the earlier stays
    assert run.best is not None and run.best.version == 0
    run.steps = 3
    run.add_eval(outcomes(3), policy.version, now)  # better: kept
    assert run.best is not None and run.best.version == policy.version == 1
    current = saved(run.best, "last")
    assert all(torch.equal(current[n], now[n]) for n in now)
