"""The rollout fleet: samples/s over Kafka with 1 and 2 worker processes, against the same
work in one process, from the same mid-trained start, for the same wall time per run.

Runs, each `--seconds` of GRPO at the bootstrap's settings:
- `inprocess`: one process, no Kafka: an engine of its own makes each step's groups, then the
  trainer steps and copies the new weights into the engine (synchronous);
- `sync`: the fleet with 1 worker and `max_staleness` 0 (trainer and worker take turns);
- `1` and `2`: the fleet with 1 and 2 workers at the bootstrap's staleness (async).
Prints each run's samples/s, trainer idle share and reward, and the bytes a policy version
costs to ship, for the in-process run's consecutive versions: Flywheel's delta, XOR of the two
versions compressed by zstd at level 1 (the usual baseline), and the raw weights (a full copy);
the fleet's stored deltas too. Ends with one JSON line.

    .venv/bin/python bench/fleet.py --seconds 90 [--model-dir data/models/base]
    .venv/bin/python bench/fleet.py --dtype bfloat16 [--lr 1e-5]   # a bf16-served policy
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.settings import Settings  # noqa: E402


def inprocess(policy: Any, cfg: Any, train: list[Any], seconds: float
              ) -> tuple[dict[str, float], list[Any]]:
    """Groups on an engine in this process, then a step, then the weights copied in; returns
    the run's figures and every policy version's weights."""
    from simulate.rollouts import SandboxCache, rollout_group
    from trainer.bootstrap.local_engine import build_harness, load_weights, make_engine
    from trainer.bootstrap.run import OfflineTrainer
    from trainer.bootstrap.task_sampler import TaskSampler

    trainer = OfflineTrainer.from_settings(policy, cfg)
    engine = make_engine(policy, cfg, seed=cfg.seed)
    harness = build_harness(engine, cfg, temperature=cfg.temperature)
    sampler, rng, cache = TaskSampler(train, floor=cfg.solved_task_weight), random.Random(0), \
        SandboxCache()
    samples, steps, rewards, slot = 0, 0, [], 0
    versions = [policy.state_dict()]
    start = time.monotonic()
    try:
        while time.monotonic() - start < seconds:
            tasks = sampler.draw(rng, cfg.groups_per_step)

            async def make(tasks: list[Any] = tasks, first: int = slot) -> list[Any]:
                return list(await asyncio.gather(*(
                    rollout_group(harness, t, group_size=cfg.group_size, cache=cache,
                                  seed=first + i) for i, t in enumerate(tasks))))

            groups = asyncio.run(make())
            slot += len(groups)
            sampler.observe(groups)
            rewards.append(trainer.step(groups)["reward"])
            versions.append(policy.state_dict())
            load_weights(engine, policy.version, versions[-1])
            samples += sum(len(g.trajectories) for g in groups)
            steps += 1
    finally:
        engine.close()
    wall = time.monotonic() - start
    return {"samples_per_s": samples / wall, "steps": steps, "trainer_idle": float("nan"),
            "reward": sum(rewards[-5:]) / max(1, len(rewards[-5:]))}, versions


def shipping_bytes(versions: list[Any]) -> dict[str, float]:
    """Mean bytes to ship one version after another: Flywheel's delta (as the fleet's
    publisher codes it), XOR + zstd-1, raw."""
    from bench.delta import xor_zstd1
    from kernels.delta import encode_delta
    from trainer.bootstrap.policy_publisher import POLICY_DELTA_OPTIONS

    pairs = list(zip(versions, versions[1:], strict=False))
    delta = [encode_delta(a, b, base_version=i, target_version=i + 1,
                          options=POLICY_DELTA_OPTIONS).manifest.nbytes
             for i, (a, b) in enumerate(pairs)]
    xor = [sum(len(blob) for blob in xor_zstd1(a, b).values()) for a, b in pairs]
    return {"delta": max(1.0, sum(delta) / max(1, len(delta))),  # 1: no version moved at all
            "xor_zstd1": sum(xor) / max(1, len(xor)),
            "full": float(sum(t.nbytes for t in versions[0].values())), "versions": len(pairs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=90.0, help="GRPO wall time per run")
    parser.add_argument("--midtrain-steps", type=int, help="default: bootstrap.midtrain_steps")
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the built model's dtype (served and shipped; float32 masters)")
    parser.add_argument("--lr", type=float, help="GRPO's rate (default: bootstrap.lr)")
    args = parser.parse_args(argv)
    settings = Settings()

    from bench.common import bench_start
    from simulate.rollouts import SandboxCache
    from trainer.bootstrap.run import run_grpo

    cfg = settings.bootstrap.model_copy(update={
        "time_budget_s": args.seconds, **({"lr": args.lr} if args.lr else {})})
    start = bench_start(cfg, settings.model.model_copy(update={"dtype": args.dtype}),
                        args.model_dir, steps=args.midtrain_steps)
    runs: dict[str, dict[str, float]] = {}
    shipped: dict[str, Any] = {}
    runs["inprocess"], versions = inprocess(start.policy(lr=cfg.lr), cfg, start.train,
                                            args.seconds)
    sizes = shipping_bytes(versions)
    del versions
    for name, update in (("sync", {"mode": "sync", "rollout_workers": 1}),
                         ("1", {"rollout_workers": 1}), ("2", {"rollout_workers": 2})):
        run = run_grpo(start.policy(lr=cfg.lr), cfg.model_copy(update=update), start.train,
                       [], cache=SandboxCache(), progress=False)
        runs[name] = {"samples_per_s": run.samples_per_s, "steps": run.steps,
                      "trainer_idle": run.trainer_idle, "reward": run.final_reward()}
        shipped = run.fleet
    for name, r in runs.items():
        print(f"{name:9s}: steps {r['steps']:4.0f}  samples/s {r['samples_per_s']:6.2f}  "
              f"trainer idle {r['trainer_idle']:5.1%}  last-5-steps reward {r['reward']:.3f}",
              flush=True)
    ratio_2 = runs["2"]["samples_per_s"] / runs["inprocess"]["samples_per_s"]
    async_sync = runs["1"]["samples_per_s"] / runs["sync"]["samples_per_s"]
    print(f"2 workers / in-process: {ratio_2:.2f}x; async / sync (1 worker): {async_sync:.2f}x "
          f"(2 shared CPU cores: noisy); per policy version ({args.dtype}, lr {cfg.lr:g}, "
          f"{sizes['versions']} in-process versions): delta {sizes['delta'] / 1e6:.3f} MB, "
          f"XOR+zstd-1 {sizes['xor_zstd1'] / 1e6:.3f} MB "
          f"({sizes['xor_zstd1'] / sizes['delta']:.2f}x the delta), raw {sizes['full'] / 1e6:.3f} "
          f"MB ({sizes['full'] / sizes['delta']:.2f}x); the fleet's stored deltas "
          f"{shipped['delta_bytes_per_version'] / 1e6:.3f} MB")
    print(json.dumps({
        "bench": "fleet",
        "samples_per_s": {k: round(runs[k]["samples_per_s"], 3) for k in ("1", "2")},
        "inprocess_samples_per_s": round(runs["inprocess"]["samples_per_s"], 3),
        "sync_samples_per_s": round(runs["sync"]["samples_per_s"], 3),
        "ratio_2_workers_vs_inprocess": round(ratio_2, 3),
        "ratio_async_sync": round(async_sync, 3),
        "trainer_idle": {k: round(runs[k]["trainer_idle"], 3) for k in ("sync", "1", "2")},
        "dtype": args.dtype, "lr": cfg.lr,
        "delta_bytes_per_version": round(sizes["delta"]),
        "xor_zstd1_bytes_per_version": round(sizes["xor_zstd1"]),
        "full_bytes_per_version": round(sizes["full"]),
        "ratio_xor_zstd1_to_delta": round(sizes["xor_zstd1"] / sizes["delta"], 3),
        "ratio_full_to_delta": round(sizes["full"] / sizes["delta"], 3),
        "fleet_delta_bytes_per_version": round(shipped["delta_bytes_per_version"]),
        "steps": {k: int(r["steps"]) for k, r in runs.items()},
        "seconds": args.seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
