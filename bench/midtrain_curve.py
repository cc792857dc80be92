"""How well mid-training's cheap quality check predicts what sampling the model achieves.

Mid-trains the default model as the demo's bootstrap does and, every `--every` steps from
`--from`, measures `QualityStop`'s score (the mean probability, at 0.7, of writing the first
call of each unseen practice task: one forward pass; the first 64 in the source's order, which
are `add`, `sub` and `mul`), the same on the held-out split and on the validation tasks
(practice tasks of every template); every second check also runs the held-out episodes with the
harness: pass@1 at 0.7 (two seeds) and greedy; and the same written probability on the product
split's tasks, the letter templates', the single-digit values' and the others' apart
(`--letter-weight`, `--digit-weight`: the letter and the digit practice templates' draw weights
in mid-training, the demo's by default). Where the score first reaches `--target` is where
`flywheel demo` stops mid-training.

    .venv/bin/python bench/midtrain_curve.py [--steps 800] [--from 450] [--every 25]
                                             [--letter-weight 4] [--digit-weight 8]

Ends with one JSON line: {"bench": "midtrain_curve", "checks": [...], "target": ...,
"letter_weight": ..., "digit_weight": ..., "first_step_at_target": ...,
"held_out_pass_at_0.7_there": ...}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.cli.demo_loop import (  # noqa: E402
    DIGIT_WEIGHT,
    MIDTRAIN_UNTIL,
    DemoPlan,
    demo_settings,
    family_weights,
)
from app.settings import Settings  # noqa: E402
from simulate.harness import ChatTokens  # noqa: E402
from simulate.rollouts import SandboxCache, pass_rate  # noqa: E402
from simulate.task_templates import LETTER_FAMILIES  # noqa: E402
from simulate.tasks import Task  # noqa: E402
from trainer.bootstrap.config import LETTER_WEIGHT, BootstrapSettings  # noqa: E402
from trainer.bootstrap.midtrain import QualityStop  # noqa: E402
from trainer.policy import Policy, Rows  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Curve(QualityStop):
    """A QualityStop that never stops: it records its score and the held-out measures."""

    cfg: BootstrapSettings = dataclasses.field(default_factory=BootstrapSettings)
    held_out: list[Task] = dataclasses.field(default_factory=list)
    # the other task sets scored each check, by name (validation, product groups)
    sets: dict[str, list[Task]] = dataclasses.field(default_factory=dict)
    start: int = 0
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    cache: SandboxCache = dataclasses.field(default_factory=SandboxCache)

    def score(self, policy: Policy, rows: Rows) -> float:
        from trainer.bootstrap.local_engine import make_engine
        from trainer.bootstrap.run import evaluate

        step = (len(self.records) + 1) * self.every
        if step < self.start:
            self.records.append({"step": step})
            return 0.0
        began = time.monotonic()
        unseen = super().score(policy, rows)
        record: dict[str, Any] = {"step": step, "unseen_written": round(unseen, 3)}
        for name, tasks in {"held_out": self.held_out, **self.sets}.items():
            check = QualityStop(tasks, self.target, self.temperature, self.every)
            written = check.score(policy, check.rows(ChatTokens(policy.tokenizer)))
            record[f"{name}_written"] = round(written, 3)
        record["check_s"] = round(time.monotonic() - began, 2)
        if (step - self.start) % (2 * self.every) == 0:
            engine = make_engine(policy, self.cfg, seed=self.cfg.seed)
            try:
                sampled = [pass_rate(evaluate(engine, self.cfg.model_copy(update={
                    "eval_temperature": self.temperature, "seed": seed}), self.held_out,
                    self.cache)) for seed in (0, 1)]
                record |= {"held_out_pass_at_0.7": sampled, "held_out_greedy": pass_rate(
                    evaluate(engine, self.cfg, self.held_out, self.cache))}
            finally:
                engine.close()
        self.records.append(record)
        print(json.dumps(record), flush=True)
        return unseen


def single_digit(task: Task) -> bool:
    """Whether the task's value is a single digit (`add_3`, `clamp_0_7`; not clamp's 0)."""
    return re.search(r"(?<![\d.])[1-9](?!\d)", task.canonical_solution or "") is not None


def main(argv: list[str] | None = None) -> int:
    import torch

    from simulate.tasks import build_task_source
    from trainer.bootstrap.midtrain import (
        corpus_tasks,
        midtrain_on,
        quality_stop,
        validation_tasks,
    )
    from trainer.init_model import init_model

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--from", dest="start", type=int, default=450)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--target", type=float, default=MIDTRAIN_UNTIL)
    parser.add_argument("--letter-weight", type=float, default=LETTER_WEIGHT)
    parser.add_argument("--digit-weight", type=float, default=DIGIT_WEIGHT)
    args = parser.parse_args(argv)

    settings = demo_settings(Settings(data_dir=Path(tempfile.mkdtemp())), DemoPlan())
    cfg = settings.bootstrap.model_copy(update={
        "midtrain_until": args.target,
        "midtrain_family_weights": family_weights(args.letter_weight, args.digit_weight)})
    torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)
    policy = Policy.load(init_model(settings.model, settings.data_dir / "base"),
                         lr=cfg.midtrain_lr)
    source = build_task_source(cfg.tasks)
    held_out = source.split("held_out")
    random.Random(cfg.seed).shuffle(held_out)
    stop = quality_stop(cfg, source)
    assert stop is not None
    product = [t for t in source.split("product") if t.canonical_solution]
    letters = [t for t in product if t.family in LETTER_FAMILIES]
    digits = [t for t in product if t not in letters and single_digit(t)]
    sets = {"validation": validation_tasks(cfg, source), "product_letters": letters,
            "product_digits": digits,
            "product_others": [t for t in product if t not in letters + digits]}
    curve = Curve(stop.tasks, 2.0, stop.temperature, args.every, cfg=cfg, held_out=held_out,
                  sets=sets, start=args.start)  # target 2.0: never reached
    midtrain_on(policy, cfg, corpus_tasks(cfg, source, source.split("train")),
                steps=args.steps, stop=curve)
    checks = [r for r in curve.records if "unseen_written" in r]
    there = next((r for r in checks if r["unseen_written"] >= args.target), None)
    sampled = next((r.get("held_out_pass_at_0.7") for r in checks
                    if there and r["step"] >= there["step"] and "held_out_pass_at_0.7" in r),
                   None)
    print(json.dumps({"bench": "midtrain_curve", "checks": checks, "target": args.target,
                      "letter_weight": args.letter_weight, "digit_weight": args.digit_weight,
                      "first_step_at_target": there and there["step"],
                      "held_out_pass_at_0.7_there": sampled}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
