"""The demo's first release, replayed offline: how the online trainer's settings move held-out
pass@1, in about a minute an arm instead of a live loop's quarter hour.

A `flywheel demo` run leaves its join database (`D/live/join.db`: every generation it logged,
with token ids, behavior logprobs and routes) and its feedback receipts (`D/live/flywheel.db`).
This rebuilds the experiences of the sessions version 0 served, exactly as the join made them
(`turn_plan`, `ExperienceReady.of`), with one approximation: the receipt keeps a verdict's kind
but not an `edit_kept` share, which is taken as 0.5. It then trains the online trainer from
`D/bootstrap/model` with the demo's settings (`demo_settings`) plus `--set` overrides on
`--steps` batches of `--batch` experiences (the sessions in the order their verdicts arrived,
or shuffled by `--seeds`), and scores held-out pass@1 as the eval gate does (8 episodes per
held-out task at 0.7, the gate's seed) every `--eval-every` steps. All of a first release is
off-policy from version 0, as it is live, so this is the first release's training, offline.

    .venv/bin/python bench/online_replay.py [--data-dir data] --seeds -1 1 2 3 \\
        [--set '{"lr": 1e-4}'] [--steps 24] [--eval-every 12]

Ends with one JSON line: version 0's held-out pass@1 and, per seed, the figure at each check.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sqlite3
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.cli.demo_loop import DemoPlan, demo_settings  # noqa: E402
from app.settings import Settings  # noqa: E402


def version0_sessions(data_dir: Path, settings: Settings) -> list[list[Any]]:
    """Per session version 0 served whole, in verdict order: its experiences, one per turn."""
    from ingest.events import ExperienceReady, FeedbackReceived, GenerationLogged
    from ingest.feedback_rewards import reward_for
    from ingest.join_sessions import turn_plan

    join = sqlite3.connect(data_dir / "live" / "join.db")
    logged = {g: GenerationLogged.model_validate_json(p)
              for g, p in join.execute("SELECT generation_id, payload FROM join_session")}
    turns: dict[str, list[str]] = collections.defaultdict(list)
    for generation, session in join.execute(
            "SELECT generation_id, session_id FROM join_session_turn ORDER BY created_at"):
        turns[session].append(generation)
    receipts = sqlite3.connect(data_dir / "live" / "flywheel.db").execute(
        "SELECT event_id, generation_id, kind FROM feedbackreceipt ORDER BY received_at")
    sessions = []
    for event_id, session, kind in receipts:
        verdict = FeedbackReceived(event_id=event_id, session_id=session, kind=kind,
                                   value=0.5 if kind == "edit_kept" else None)
        generations = [logged[g] for g in turns.get(session, []) if g in logged]
        plan = turn_plan(verdict, generations, reward_for(verdict, settings.join.rewards),
                         settings.join.session_discount)
        if plan and all(g.model_version == 0 for g, _, _ in plan):
            sessions.append([ExperienceReady.of(g, verdict, r, turn=t.turn, turns=t.turns)
                             for g, t, r in plan])
    return sessions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path("data"),
                        help="a finished demo run's data dir (make demo's: data)")
    parser.add_argument("--set", default="{}", help="online trainer settings, JSON")
    parser.add_argument("--steps", type=int, default=DemoPlan.release_every_steps)
    parser.add_argument("--batch", type=int, default=DemoPlan.online_batch)
    parser.add_argument("--eval-every", type=int, default=12)
    parser.add_argument("--seeds", type=int, nargs="+", default=[-1],
                        help="-1: the order the verdicts arrived; else a shuffle of sessions")
    args = parser.parse_args()
    if not (args.data_dir / "live" / "join.db").exists():
        print(json.dumps({"bench": "online_replay", "skipped": f"no demo run in {args.data_dir} "
                          "(make demo first, or --data-dir of one)"}))
        return

    import torch
    from transformers import AutoTokenizer

    from trainer.online.trainer import OnlineTrainer
    from trainer.release.eval_gate import build_eval_suite

    torch.set_num_threads(1)
    settings = demo_settings(Settings(), DemoPlan())
    cfg = type(settings.online).model_validate({  # --set may hold nested settings (anchor)
        **settings.online.model_dump(), **json.loads(args.set),
        "min_batch": args.batch, "max_batch": args.batch})
    model_dir = args.data_dir / "bootstrap" / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    suite = build_eval_suite(settings.release.eval, tasks=settings.bootstrap.tasks,
                             harness=settings.bootstrap.harness(temperature=0.0))
    sessions = version0_sessions(args.data_dir, settings)

    def held_out(trainer: OnlineTrainer) -> float:
        model = trainer.served.model.eval()  # the weights a release would serve
        score = suite.evaluate(model, tokenizer).metrics["pass_at_1"]
        model.train()
        return round(100 * score, 2)

    figures: dict[str, dict[int, float]] = {}
    version0: float | None = None
    for seed in args.seeds:
        order = list(sessions)
        if seed >= 0:
            random.Random(seed).shuffle(order)
        experiences = [e for session in order for e in session]
        trainer = OnlineTrainer.restore(cfg, model_dir, Path(tempfile.mkdtemp()))
        if version0 is None:
            version0 = held_out(trainer)
            print(f"version 0: held-out pass@1 {version0}% ({len(experiences)} experiences "
                  f"of {len(sessions)} sessions)", flush=True)
        figures[str(seed)] = {}
        for step in range(1, args.steps + 1):
            batch = experiences[(step - 1) * args.batch:step * args.batch]
            metrics = trainer.step(batch)
            if step % args.eval_every == 0 or step == args.steps:
                figures[str(seed)][step] = held_out(trainer)
                anchored = (f", anchor kl {metrics['anchor_kl']:.4f}" if "anchor_kl" in metrics
                            else "")
                print(f"seed {seed} step {step}: held-out {figures[str(seed)][step]}% "
                      f"(kl {metrics['kl']:.4f}{anchored})", flush=True)
    print(json.dumps({"bench": "online_replay", "settings": json.loads(args.set),
                      "steps": args.steps, "batch": args.batch, "version0_held_out": version0,
                      "held_out_by_seed": figures}))


if __name__ == "__main__":
    main()
