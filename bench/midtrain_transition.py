"""Where mid-training's copying of a parameter forms, by learning rate and seed.

The copying of a task's parameter into its solution forms as a transition, and where it forms
moves with the seed (the order of the corpus) and the machine's float order. For each rate of
`--lrs` and seed of `--seeds`, this mid-trains the default model from the same initial weights
until `QualityStop`'s score (the mean probability, at 0.7, of writing the first call of each
unseen practice task) reaches `--target`, checking every `--every` steps, at most `--steps`;
a run that never reaches it counts as None. The rate with the earliest and steadiest
transition is mid-training's default (`BootstrapSettings.midtrain_lr`).

    .venv/bin/python bench/midtrain_transition.py [--lrs 1e-3 3e-3] [--seeds 0 1]
                                                  [--steps 1000] [--target 0.3]

Ends with one JSON line: {"bench": "midtrain_transition", "target": ..., "max_steps": ...,
"steps_to_target": {"<lr>": [<steps or null per seed>, ...]}, "wall_s": {"<lr>": [...]}}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.settings import Settings  # noqa: E402
from trainer.bootstrap.config import BootstrapSettings  # noqa: E402


def steps_to_target(cfg: BootstrapSettings, base: Path) -> int | None:
    """Mid-train a fresh copy of `base` under `cfg` until its quality stop; the steps it took,
    or None when `cfg.midtrain_steps` ran out first."""
    from simulate.tasks import build_task_source
    from trainer.bootstrap.midtrain import corpus_tasks, midtrain_on, quality_stop
    from trainer.policy import Policy

    source = build_task_source(cfg.tasks)
    policy = Policy.load(base, lr=cfg.midtrain_lr)
    result = midtrain_on(policy, cfg, corpus_tasks(cfg, source, source.split("train")),
                         stop=quality_stop(cfg, source))
    reached = result.checks and result.checks[-1][1] >= (cfg.midtrain_until or 0.0)
    return result.steps if reached else None


def main(argv: list[str] | None = None) -> int:
    from trainer.init_model import init_model

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--target", type=float, default=0.3)
    args = parser.parse_args(argv)

    settings = Settings(data_dir=Path(tempfile.mkdtemp()))
    base = init_model(settings.model, settings.data_dir / "base")
    found: dict[str, list[int | None]] = {}
    walls: dict[str, list[float]] = {}
    for lr in args.lrs:
        for seed in args.seeds:
            cfg = settings.bootstrap.model_copy(update={
                "midtrain_lr": lr, "seed": seed, "midtrain_steps": args.steps,
                "midtrain_until": args.target, "midtrain_check_every": args.every})
            began = time.monotonic()
            steps = steps_to_target(cfg, base)
            found.setdefault(str(lr), []).append(steps)
            walls.setdefault(str(lr), []).append(round(time.monotonic() - began, 1))
            print(json.dumps({"lr": lr, "seed": seed, "steps_to_target": steps,
                              "wall_s": walls[str(lr)][-1]}), flush=True)
    print(json.dumps({"bench": "midtrain_transition", "target": args.target,
                      "max_steps": args.steps, "steps_to_target": found, "wall_s": walls}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
