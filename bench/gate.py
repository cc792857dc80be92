"""The eval gate's error rates: how often it refuses a candidate as good as the served version,
and how often it refuses a damaged one.

The served model is a bootstrapped one (`--model`; default the one `make demo` leaves in
`<data dir>/bootstrap/model`, built as the demo builds it when missing); the damaged candidate is a
copy of it with every tensor plus Gaussian noise of `--damage` times its own standard
deviation (noise seed `--seed`). On a demo's version 0 (34% pass@1 at 0.7) noise of 0.1 cost
1 point, 0.3 cost 8, 0.5 cost 31, and 0.4 anywhere from 3 to 34 with the noise seed: one
damaged copy per run, whose drop the run measures (the mean over its trials), states what
was caught. Each of `--trials` trials evaluates, with the release's held-out suite
(`FLYWHEEL_RELEASE__EVAL__*`: the tasks, samples per task, temperature), the served model
twice and the damaged copy once, every evaluation with sampling seeds of its own (`--seed`
shifts them all: runs with different seeds are independent), and asks the gate
(`trainer.release.eval_gate.gate`):
- the served model against itself as the candidate: a refusal is a false refusal;
- the damaged copy against the served model: a refusal is right.
The release pipeline samples both versions with the same seeds, which only makes their
difference less noisy: independent seeds here are the harder case for both rates. The
baseline in the same run is the gate before it (greedy pass@1, one episode per task, refusing
a drop of more than 5 points) on the same damaged copy; greedy decoding repeats itself, so it
decides once, and against the served model itself it cannot err: its false refusals were of
different candidates as good as the served one, which no trial here can construct. Ends with
one JSON line: {"bench": "gate", "false_refusal_rate", "damaged_refusal_rate", "trials", ...}.

    .venv/bin/python bench/gate.py [--trials 20] [--damage 0.4] [--seed 0] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.settings import Settings  # noqa: E402

LEGACY_MARGIN_POINTS = 5.0  # the gate before the paired test: greedy, a bare 5-point margin


def served_model(settings: Settings, path: Path | None) -> Path:
    """`path`, or the demo's bootstrapped model under the data dir (built when missing)."""
    if path is not None:
        if not (path / "config.json").exists():
            raise SystemExit(f"bench/gate.py: no model in {path}")
        return path
    from app.cli.demo_loop import DemoPlan, bootstrapped_model, demo_settings

    return bootstrapped_model(demo_settings(settings, DemoPlan()))[0]


def damaged(weights: dict[str, Any], scale: float, seed: int) -> dict[str, Any]:
    """Every floating tensor plus N(0, (scale * its std)^2) noise (tied tensors stay tied:
    the state dict holds them as one)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        if t.is_floating_point() and t.numel() > 1:
            t = t + scale * float(t.float().std()) * torch.randn(t.shape, generator=gen)
        out[name] = t
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--damage", type=float, default=0.4,
                        help="noise per tensor, in units of the tensor's standard deviation")
    parser.add_argument("--seed", type=int, default=0,
                        help="the damage's noise seed; shifts every sampling seed too")
    parser.add_argument("--model", type=Path,
                        help="the served model (default: the demo's, data/bootstrap/model)")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.release.config import HeldOutTasksEval
    from trainer.release.eval_gate import HeldOutTasksSuite, Scores, gate

    started = time.monotonic()
    settings = Settings()
    torch.set_num_threads(1)
    path = served_model(settings, args.model and args.model.resolve())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    served_weights = {n: t.detach().clone() for n, t in model.state_dict().items()}
    cfg = settings.release.eval
    assert isinstance(cfg, HeldOutTasksEval), "the bench measures the held-out tasks gate"
    harness = settings.bootstrap.harness(temperature=cfg.temperature)
    suite = HeldOutTasksSuite(cfg, tasks=settings.bootstrap.tasks, harness=harness)
    greedy = HeldOutTasksSuite(cfg.model_copy(update={
        "samples_per_task": 1, "temperature": 0.0, "max_drop_points": LEGACY_MARGIN_POINTS}),
        tasks=settings.bootstrap.tasks, harness=harness)
    greedy_served = greedy.evaluate(model, tokenizer)
    broken = damaged(served_weights, args.damage, seed=args.seed)
    model.load_state_dict(broken)
    legacy = gate(greedy, Scores(greedy.evaluate(model, tokenizer).metrics),
                  Scores(greedy_served.metrics))  # the bare margin: no per-task scores
    print(f"served {path}: greedy pass@1 {greedy_served.metrics['pass_at_1']:.1%} on "
          f"{len(suite.tasks)} held-out tasks, damaged {legacy.candidate['pass_at_1']:.1%} "
          f"({'refused' if not legacy.passed else 'passed'} by the greedy 5-point gate); "
          f"{args.trials} trials of {cfg.samples_per_task} samples per task at temperature "
          f"{cfg.temperature}", flush=True)

    false_refusals, refusals = 0, 0
    served_p, damaged_p, stderrs = [], [], []
    for trial in range(args.trials):
        seed = 10_000 * (3 * (args.seed * args.trials + trial) + 1)
        model.load_state_dict(served_weights)
        first = suite.evaluate_seeded(model, tokenizer, seed=seed)
        second = suite.evaluate_seeded(model, tokenizer, seed=seed + 10_000)
        model.load_state_dict(broken)
        bad = suite.evaluate_seeded(model, tokenizer, seed=seed + 20_000)
        same, worse = gate(suite, second, first), gate(suite, bad, first)
        false_refusals += not same.passed
        refusals += not worse.passed
        served_p += [first.metrics["pass_at_1"], second.metrics["pass_at_1"]]
        damaged_p.append(bad.metrics["pass_at_1"])
        stderrs += [c.stderr for c in (same.change, worse.change) if c is not None]
        print(f"trial {trial + 1}/{args.trials}: served {first.metrics['pass_at_1']:.1%} / "
              f"{second.metrics['pass_at_1']:.1%} ({'refused' if not same.passed else 'passed'}"
              f"), damaged {bad.metrics['pass_at_1']:.1%} "
              f"({'refused' if not worse.passed else 'passed'})", flush=True)

    drop = 100 * (statistics.fmean(served_p) - statistics.fmean(damaged_p))
    print(json.dumps({
        "bench": "gate",
        "false_refusal_rate": round(false_refusals / args.trials, 3),
        "damaged_refusal_rate": round(refusals / args.trials, 3),
        "trials": args.trials,
        "tasks": len(suite.tasks), "samples_per_task": cfg.samples_per_task,
        "temperature": cfg.temperature, "max_drop_points": cfg.max_drop_points,
        "confidence": cfg.confidence, "damage": args.damage, "seed": args.seed,
        "served_pass_at_1": round(statistics.fmean(served_p), 4),
        "damaged_pass_at_1": round(statistics.fmean(damaged_p), 4),
        "damaged_drop_points": round(drop, 1),
        "stderr_points": round(100 * statistics.fmean(stderrs), 2),
        "legacy_greedy_served_pass_at_1": greedy_served.metrics["pass_at_1"],
        "legacy_greedy_damaged_pass_at_1": legacy.candidate["pass_at_1"],
        "legacy_damaged_refused": not legacy.passed,
        "wall_s": round(time.monotonic() - started, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
