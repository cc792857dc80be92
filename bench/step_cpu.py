"""Where one GRPO step's CPU goes: the engine's rollouts, their sandbox jobs, the update.

From the mid-trained start, one in-process engine makes a step's groups (`groups_per_step` x
`group_size` episodes), then `OfflineTrainer.step` trains on them; repeated `--steps` times
after one warm-up step, nothing overlapped. Rollout CPU is this process's (engine, harness);
"other" is the rest of the machine's busy time meanwhile (/proc/stat), i.e. the sandbox jobs
forked by the zygote, on an otherwise idle machine. The sum bounds any pipelining on N cores:
a step cannot take less than total CPU / N.

    .venv/bin/python bench/step_cpu.py [--steps 5] [--model-dir data/models/base]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.settings import Settings  # noqa: E402
from bench.sandbox import machine_busy_s  # noqa: E402


def cpu_s() -> tuple[float, float]:
    """(this process's CPU, the machine's busy time), both in seconds."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime, machine_busy_s()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--midtrain-steps", type=int, help="default: bootstrap.midtrain_steps")
    parser.add_argument("--model-dir", type=Path)
    args = parser.parse_args(argv)
    settings = Settings()


    from bench.common import bench_start
    from simulate.rollouts import SandboxCache, rollout_group
    from trainer.bootstrap.local_engine import build_harness, make_engine
    from trainer.bootstrap.run import OfflineTrainer

    cfg = settings.bootstrap
    start = bench_start(cfg, settings.model, args.model_dir, steps=args.midtrain_steps)
    policy = start.policy(lr=cfg.lr)
    trainer = OfflineTrainer.from_settings(policy, cfg)
    engine = make_engine(policy, cfg, seed=cfg.seed)
    harness = build_harness(engine, cfg, temperature=cfg.temperature)
    cache = SandboxCache()
    totals = dict.fromkeys(("rollout_wall_s", "rollout_process_cpu_s", "other_cpu_s",
                            "trainer_cpu_s", "sandbox_jobs"), 0.0)
    try:
        for step in range(args.steps + 1):
            rng = random.Random(cfg.seed + step)
            tasks = [rng.choice(start.train) for _ in range(cfg.groups_per_step)]

            async def groups() -> list:  # type: ignore[type-arg]
                return list(await asyncio.gather(*(rollout_group(
                    harness, task, group_size=cfg.group_size, cache=cache,
                    seed=1000 * step + i) for i, task in enumerate(tasks))))  # noqa: B023

            jobs, wall = cache.misses, time.perf_counter()
            own, busy = cpu_s()
            made = asyncio.run(groups())
            rollout_wall = time.perf_counter() - wall
            own_after, busy_after = cpu_s()
            trainer.step(made)
            own_trained, _ = cpu_s()
            if step == 0:
                continue  # warm-up
            totals["rollout_wall_s"] += rollout_wall
            totals["rollout_process_cpu_s"] += own_after - own
            totals["other_cpu_s"] += (busy_after - busy) - (own_after - own)
            totals["trainer_cpu_s"] += own_trained - own_after
            totals["sandbox_jobs"] += cache.misses - jobs
    finally:
        engine.close()
    per_step = {k: round(v / args.steps, 3) for k, v in totals.items()}
    total = per_step["rollout_process_cpu_s"] + per_step["other_cpu_s"] + per_step["trainer_cpu_s"]
    samples = cfg.groups_per_step * cfg.group_size
    for key, value in per_step.items():
        print(f"{key:24s} {value:7.3f} per step")
    print(f"{total:.2f} CPU-s a step of {samples} episodes: on {os.cpu_count()} cores at most "
          f"{samples * (os.cpu_count() or 1) / total:.1f} samples/s")
    print(json.dumps({"bench": "step_cpu", "steps": args.steps, "samples_per_step": samples}
                     | per_step | {"total_cpu_s": round(total, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
