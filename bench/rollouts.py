"""Rollout throughput of the bootstrap's engine with and without prefix caching.

Makes the same GRPO groups (the same train tasks, seeds and mid-trained weights) on two
engines that differ only in `prefix_cache_tokens`, alternating them round by round so that a
shared machine's drift hits both, and prints samples/s per engine, prefill tokens fed, the
cache's hits and the cached/uncached ratio. No training: the policy does not change.

    .venv/bin/python bench/rollouts.py [--rounds 3] [--groups 8] [--midtrain-steps 350]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.settings import Settings  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--groups", type=int, default=8, help="groups made together per round")
    parser.add_argument("--midtrain-steps", type=int, help="default: bootstrap.midtrain_steps")
    parser.add_argument("--model-dir", type=Path)
    args = parser.parse_args(argv)
    settings = Settings()


    from bench.common import bench_start
    from simulate.rollouts import SandboxCache, rollout_group
    from trainer.bootstrap.local_engine import build_harness, make_engine

    cfg = settings.bootstrap
    start = bench_start(cfg, settings.model, args.model_dir, steps=args.midtrain_steps)
    policy = start.policy(lr=cfg.lr)
    tokens = cfg.prefix_cache_tokens or type(cfg).model_fields["prefix_cache_tokens"].default
    engines = {"uncached": make_engine(policy, cfg.model_copy(update={"prefix_cache_tokens": 0}),
                                       seed=cfg.seed),
               "cached": make_engine(policy, cfg.model_copy(update={"prefix_cache_tokens": tokens}),
                                     seed=cfg.seed)}
    caches = {name: SandboxCache() for name in engines}  # each pays for its own tool calls
    seconds = {name: 0.0 for name in engines}
    samples = 0
    try:
        for r in range(args.rounds):
            rng = random.Random(cfg.seed + r)
            tasks = [rng.choice(start.train) for _ in range(args.groups)]
            for name, engine in engines.items():
                harness = build_harness(engine, cfg, temperature=cfg.temperature)

                async def groups() -> None:
                    await asyncio.gather(*(rollout_group(
                        harness, task, group_size=cfg.group_size, cache=caches[name],  # noqa: B023
                        seed=1000 * r + i) for i, task in enumerate(tasks)))  # noqa: B023

                began = time.perf_counter()
                asyncio.run(groups())
                seconds[name] += time.perf_counter() - began
            samples += args.groups * cfg.group_size
            print(f"round {r + 1}: " + "  ".join(
                f"{n} {samples / s:6.2f} samples/s" for n, s in seconds.items()), flush=True)
        pc = engines["cached"].prefix_cache
        assert pc is not None
        rates = {n: samples / s for n, s in seconds.items()}
        ratio = rates["cached"] / rates["uncached"]
        fed = {n: e.prefilled_tokens for n, e in engines.items()}
        print(f"prefill tokens fed: uncached {fed['uncached']}, cached {fed['cached']} "
              f"({pc.hits} hits of {pc.lookups} prefills)")
        print(f"cached/uncached samples/s: {ratio:.2f}x")
        print(json.dumps({"bench": "rollouts", "samples": samples,
                          "uncached_samples_per_s": round(rates["uncached"], 3),
                          "cached_samples_per_s": round(rates["cached"], 3),
                          "ratio": round(ratio, 3), "prefill_tokens_uncached": fed["uncached"],
                          "prefill_tokens_cached": fed["cached"], "prefix_hits": pc.hits,
                          "prefills": pc.lookups}))
    finally:
        for engine in engines.values():
            engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
