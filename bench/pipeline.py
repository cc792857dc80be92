"""Sync vs pipelined (async) GRPO for the same wall time, from the same mid-trained start.

Prints trainer idle fraction, rollout idle fraction, samples/s and reward reached per mode,
the async/sync samples/s ratio, and ends with one JSON line. "Reward reached" is the final
policy's expected reward on one fixed list of train tasks (`--eval-tasks` tasks x
`--eval-samples` episodes at the training temperature), the same list for both modes; the mean
rollout reward of each run's last 5 steps is printed too, but it depends on which tasks those
steps drew.

    .venv/bin/python bench/pipeline.py --seconds 120 [--model-dir data/models/base]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.settings import Settings  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=120.0, help="GRPO wall time per mode")
    parser.add_argument("--midtrain-steps", type=int, help="default: bootstrap.midtrain_steps")
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--max-staleness", type=int, help="default: bootstrap.max_staleness")
    parser.add_argument("--clip-anchor", choices=["trainer", "behavior"],
                        help="default: bootstrap.clip_anchor")
    parser.add_argument("--eval-tasks", type=int, default=32)
    parser.add_argument("--eval-samples", type=int, default=4)
    args = parser.parse_args(argv)
    settings = Settings()

    import random

    from bench.common import bench_start
    from simulate.rollouts import SandboxCache, pass_rate
    from trainer.local_engine import make_engine
    from trainer.offline import evaluate, mean_reward, run_grpo

    cfg = settings.bootstrap.model_copy(update={
        "time_budget_s": args.seconds,
        "max_staleness": settings.bootstrap.max_staleness if args.max_staleness is None
        else args.max_staleness,
        "clip_anchor": args.clip_anchor or settings.bootstrap.clip_anchor})
    start = bench_start(cfg, settings.model, args.model_dir, steps=args.midtrain_steps)
    eval_tasks = random.Random(cfg.seed).sample(start.train, min(args.eval_tasks,
                                                                  len(start.train)))
    results, reached, held_out = {}, {}, {}
    for mode in ("sync", "async"):
        policy = start.policy(lr=cfg.lr)
        cache = SandboxCache()
        run = run_grpo(policy, cfg.model_copy(update={"mode": mode}), start.train,
                       start.held_out, cache=cache, progress=False)
        results[mode] = run
        reached[mode] = mean_reward(policy, cfg, eval_tasks, samples=args.eval_samples,
                                    cache=cache)
        engine = make_engine(policy, cfg, seed=cfg.seed)
        try:
            held_out[mode] = pass_rate(evaluate(engine, cfg, start.held_out, cache))
        finally:
            engine.close()
        print(f"{mode:5s}: steps {run.steps:3d}  samples/s {run.samples_per_s:6.2f}  "
              f"trainer idle {run.trainer_idle:5.1%}  "
              f"reward reached {reached[mode]:.3f}  last-5-steps rollout reward "
              f"{run.final_reward():.3f}  held-out pass@1 {held_out[mode]:.3f}", flush=True)
    sync, pipelined = results["sync"], results["async"]
    ratio = pipelined.samples_per_s / max(1e-9, sync.samples_per_s)
    print(f"async/sync samples/s: {ratio:.2f}x (2 shared CPU cores: noisy)")
    print(json.dumps({"bench": "pipeline", "sync_samples_per_s": round(sync.samples_per_s, 3),
                      "async_samples_per_s": round(pipelined.samples_per_s, 3),
                      "ratio": round(ratio, 3), "trainer_idle_sync": round(sync.trainer_idle, 3),
                      "trainer_idle_async": round(pipelined.trainer_idle, 3),
                      "reward_sync": round(reached["sync"], 3),
                      "reward_async": round(reached["async"], 3),
                      "last_steps_reward_sync": round(sync.final_reward(), 3),
                      "last_steps_reward_async": round(pipelined.final_reward(), 3),
                      "held_out_pass_at_1_sync": round(held_out["sync"], 3),
                      "held_out_pass_at_1_async": round(held_out["async"], 3),
                      "steps_sync": sync.steps, "steps_async": pipelined.steps,
                      "max_staleness": cfg.max_staleness, "clip_anchor": cfg.clip_anchor}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
