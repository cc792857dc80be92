"""Is self-summarization worth it? GRPO on the long tasks, summarizing against truncating.

From one mid-trained start, two GRPO runs of `--grpo-steps` steps on the long train tasks,
at the same context budget and the same step count, one per `context_overflow`. The start is
the default model mid-trained in two stages, easy to hard: `--oneline-steps` on the corpus
of `flywheel bootstrap` (the one-line tasks and their practice tasks: short rows that teach
the tool format and copying a value from what was read, in a few minutes), then
`--midtrain-steps` on the demonstrations of the long tasks (simulate/package_tasks.py: their
train split and practice tasks), each summarized where the harness would summarize it.
Mid-trained on the long tasks alone, the model had their format by 300 steps, but at 600
(2.4 s a step on two cores) it wrote a held-out task's two fixes with the right values 8%
and 15% of the time and its summary never (teacher-forced, greedy), and solved none; after
the one-line stage, 300 long steps got to 54%, 85% and 15%.

- `summarize`: past the budget the model summarizes its work and goes on from its summary
  (the summary's tokens are trained with the episode's advantage);
- `truncate`: the baseline; past the budget the oldest turns are dropped and a fresh context
  opens with the newest calls and results as they were.

Each is then scored on the held-out long tasks in its own mode: `--samples` episodes per task
at 0.7. `noise` is 1.96 x the standard error of the difference of the two pass@1 (each a
binomial over its episodes): a gap below it is not one. `turns_per_episode` and
`summaries_per_episode` are the summarize run's evaluation episodes'.

    .venv/bin/python bench/horizon.py [--oneline-steps 600] [--midtrain-steps 600]
                                      [--grpo-steps 20] [--samples 4]

Ends with one JSON line: {"bench": "horizon", "summarize_pass_at_1": ..., "truncate_pass_at_1":
..., "noise": ..., "turns_per_episode": ..., "summaries_per_episode": ..., "truncate_turns_per_
episode": ..., "summarize_reward": ..., "truncate_reward": ..., "reward_noise": ...,
"held_out_tasks": ..., "oneline_steps": ..., "midtrain_steps": ..., "grpo_steps": ...,
"wall_s": {...}}.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.settings import Settings  # noqa: E402
from simulate.tasks import BuiltinTasksConfig, Task  # noqa: E402
from trainer.bootstrap.config import BootstrapSettings  # noqa: E402

MODES = ("summarize", "truncate")
TEMPERATURE = 0.7  # the held-out episodes', as the developers' and the eval gate's


def score(policy: Any, cfg: BootstrapSettings, tasks: list[Task], *,
          samples: int) -> dict[str, float]:
    """pass@1 over `samples` seeded episodes per task at `TEMPERATURE`, the mean reward (the
    partial credit below a solve: 0.5 x the share of hidden tests passed) with its variance,
    and their shape."""
    from simulate.rollouts import SandboxCache, episode_shape, solved
    from trainer.bootstrap.local_engine import sample_episodes

    episodes = sample_episodes(policy, cfg, tasks, samples=samples, cache=SandboxCache(),
                               temperature=TEMPERATURE)
    passes = [float(solved(t)) for t in episodes]
    rewards = [t.reward for t in episodes]
    return {"pass_at_1": statistics.fmean(passes), "pass_var": statistics.pvariance(passes),
            "reward": statistics.fmean(rewards), "reward_var": statistics.pvariance(rewards),
            "episodes": len(episodes), **episode_shape(episodes)}


def noise(var_a: float, var_b: float, n: int) -> float:
    """1.96 x the standard error of the difference of two means over `n` episodes each, from
    the episodes' variances (a pass rate's is p(1 - p), a binomial's)."""
    return 1.96 * math.sqrt((var_a + var_b) / max(1, n))


def main(argv: list[str] | None = None) -> int:
    from simulate.rollouts import SandboxCache, mean_episode_shape
    from simulate.tasks import build_task_source
    from trainer.bootstrap.midtrain import corpus_tasks, midtrain_on
    from trainer.bootstrap.run import run_grpo
    from trainer.init_model import init_model
    from trainer.policy import Policy

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--oneline-steps", type=int, default=600)
    parser.add_argument("--midtrain-steps", type=int, default=600)
    parser.add_argument("--grpo-steps", type=int, default=20)
    parser.add_argument("--samples", type=int, default=4)
    args = parser.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="horizon-"))
    settings = Settings(data_dir=root)
    tasks = BuiltinTasksConfig(packages=True, product_fraction=0.0)
    cfg = settings.bootstrap.model_copy(update={
        "tasks": tasks, "max_steps": args.grpo_steps, "time_budget_s": None,
        "keep_best": False, "eval_every": args.grpo_steps})
    source = build_task_source(tasks)
    train = [t for t in source.split("train") if t.fixes]
    practice = [t for t in source.practice_tasks() if t.fixes]
    held_out = [t for t in source.split("held_out") if t.fixes]
    base = init_model(settings.model, root / "base")

    started = time.monotonic()
    policy = Policy.load(base, lr=cfg.midtrain_lr)
    easy = build_task_source(settings.bootstrap.tasks)  # `flywheel bootstrap`'s own tasks
    midtrain_on(policy, settings.bootstrap, corpus_tasks(settings.bootstrap, easy,
                                                         easy.split("train")),
                steps=args.oneline_steps, progress=True)
    midtrain_on(policy, cfg, train + practice, steps=args.midtrain_steps, progress=True)
    start = policy.state_dict()
    wall = {"midtrain": round(time.monotonic() - started, 1)}

    results: dict[str, dict[str, float]] = {}
    for mode in MODES:
        began = time.monotonic()
        mode_cfg = cfg.model_copy(update={"context_overflow": mode})
        learner = Policy.load(base, lr=cfg.lr)
        learner.load_weights(start)
        run = run_grpo(learner, mode_cfg, train, [], cache=SandboxCache(), progress=True,
                       work_dir=root / mode)
        results[mode] = score(learner, mode_cfg, held_out, samples=args.samples) | {
            f"train_{k}": v for k, v in mean_episode_shape(run.history).items()}
        wall[mode] = round(time.monotonic() - began, 1)
        print(mode, json.dumps(results[mode]), flush=True)

    summarize, truncate = results["summarize"], results["truncate"]
    episodes = int(summarize["episodes"])
    print(json.dumps({
        "bench": "horizon",
        "summarize_pass_at_1": round(summarize["pass_at_1"], 4),
        "truncate_pass_at_1": round(truncate["pass_at_1"], 4),
        "noise": round(noise(summarize["pass_var"], truncate["pass_var"], episodes), 4),
        "turns_per_episode": round(summarize["turns_per_episode"], 2),
        "summaries_per_episode": round(summarize["summaries_per_episode"], 2),
        "truncate_turns_per_episode": round(truncate["turns_per_episode"], 2),
        # the partial credit: it separates the modes where neither solves a held-out task
        "summarize_reward": round(summarize["reward"], 4),
        "truncate_reward": round(truncate["reward"], 4),
        "reward_noise": round(noise(summarize["reward_var"], truncate["reward_var"], episodes),
                              4),
        "held_out_tasks": len(held_out), "oneline_steps": args.oneline_steps,
        "midtrain_steps": args.midtrain_steps,
        "grpo_steps": args.grpo_steps, "wall_s": wall}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
