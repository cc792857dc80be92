"""Sync vs pipelined (async) GRPO for the same wall time, from the same mid-trained start.

Prints trainer idle fraction, rollout idle fraction, samples/s and reward reached per mode,
the async/sync samples/s ratio, and ends with one JSON line.

    .venv/bin/python bench/pipeline.py --seconds 120 [--model-dir data/models/base]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.settings import Settings  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=120.0, help="GRPO wall time per mode")
    parser.add_argument("--midtrain-steps", type=int, help="default: bootstrap.midtrain_steps")
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--max-staleness", type=int, default=2)
    args = parser.parse_args(argv)
    settings = Settings()

    import torch

    from simulate.rollouts import SandboxCache
    from trainer.init_model import init_model
    from trainer.midtrain import midtrained_start
    from trainer.offline import run_grpo

    cfg = settings.bootstrap.model_copy(update={"time_budget_s": args.seconds,
                                                "max_staleness": args.max_staleness})
    model_dir = args.model_dir or init_model(settings.model,
                                             Path(tempfile.mkdtemp()) / "base")
    torch.set_num_threads(cfg.torch_threads)
    start = midtrained_start(cfg, model_dir, steps=args.midtrain_steps)
    results = {}
    for mode in ("sync", "async"):
        run = run_grpo(start.policy(lr=cfg.lr), cfg.model_copy(update={"mode": mode}),
                       start.train, start.held_out, cache=SandboxCache(), progress=False)
        results[mode] = run
        print(f"{mode:5s}: steps {run.steps:3d}  samples/s {run.samples_per_s:6.2f}  "
              f"trainer idle {run.trainer_idle:5.1%}  rollout idle {run.rollout_idle:5.1%}  "
              f"reward {run.final_reward():.3f}", flush=True)
    sync, pipelined = results["sync"], results["async"]
    ratio = pipelined.samples_per_s / max(1e-9, sync.samples_per_s)
    print(f"async/sync samples/s: {ratio:.2f}x (2 shared CPU cores: noisy)")
    print(json.dumps({"bench": "pipeline", "sync_samples_per_s": round(sync.samples_per_s, 3),
                      "async_samples_per_s": round(pipelined.samples_per_s, 3),
                      "ratio": round(ratio, 3), "trainer_idle_sync": round(sync.trainer_idle, 3),
                      "trainer_idle_async": round(pipelined.trainer_idle, 3),
                      "reward_sync": round(sync.final_reward(), 3),
                      "reward_async": round(pipelined.final_reward(), 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
