"""The canary's sequential test against a simulation's truth: how many sessions it takes to roll
back a candidate 10 points worse than the incumbent and to promote an equal one, and how often
it gets either wrong, at the error rates of `CanarySettings` (trainer/release/config.py) or
`--share`, `--alpha`, `--beta`.

Each trial draws sessions one by one, each on the candidate with probability `share` (the
sticky assignment by session id is a fair coin per session), and judges them the way the
demo's simulated developers do (simulate/developers.py): the session's tests pass with its
arm's true acceptance rate, a failing session keeps part of its edit with probability
`--partial`, the verdict is misjudged with probability 0.05, and the reward is the join's
(`ingest.feedback_rewards.reward_for`). `trainer.release.canary.CanaryTest` sees each verdict
and decides; the trial ends at its decision. The baseline in the same run is the
fixed-horizon test of the same error rates on acceptance (a one-sided z-test, its sample size
from the arms' true variance): the sessions it needs whatever the candidate is. Ends with one
JSON line: {"bench": "canary", "sessions_to_rollback_worse_10", "sessions_to_promote_equal",
"promote_worse_rate", "rollback_equal_rate", "fixed_horizon_sessions", ...}.

    .venv/bin/python bench/canary.py [--trials 400] [--acceptance 0.4] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingest.config import RewardMap  # noqa: E402
from ingest.events import FeedbackReceived  # noqa: E402
from ingest.feedback_rewards import reward_for  # noqa: E402
from simulate.developers import verdict, with_noise  # noqa: E402
from trainer.release.canary import Arm, CanarySession, CanaryTest  # noqa: E402
from trainer.release.config import CanarySettings  # noqa: E402

WORSE_BY = 0.10  # the candidate the test must roll back: 10 points of acceptance below
NOISE = 0.05  # the simulated developers' misjudged verdicts


def judged_session(arm: Arm, acceptance: float, partial: float, rewards: RewardMap,
                   rng: random.Random) -> CanarySession:
    """One session of `arm` judged as a simulated developer judges it."""
    if rng.random() < acceptance:
        passed = 1.0
    else:
        passed = rng.uniform(0.2, 0.8) if rng.random() < partial else 0.0
    kind, value = with_noise(*verdict(passed, ()), flip=rng.random() < NOISE)
    feedback = FeedbackReceived(event_id="e", session_id="s", kind=kind, value=value)
    return CanarySession(arm, kind == "accept", reward_for(feedback, rewards))


def trial(settings: CanarySettings, incumbent: float, candidate: float, partial: float,
          rewards: RewardMap, rng: random.Random) -> tuple[str, int]:
    """(decision, sessions of both arms it took)."""
    test = CanaryTest(settings)
    sessions = 0
    while True:
        on_candidate = rng.random() < settings.share
        arm: Arm = "candidate" if on_candidate else "incumbent"
        test.add(judged_session(arm, candidate if on_candidate else incumbent, partial,
                                rewards, rng))
        sessions += 1
        decision = test.decide()
        if decision != "continue":
            return decision, sessions


def fixed_horizon_sessions(settings: CanarySettings, acceptance: float) -> int:
    """Sessions of both arms a one-sided z-test on acceptance needs to tell equal from
    `WORSE_BY` worse at the same alpha and beta (the arms' variance at `acceptance`, after
    the misjudged verdicts)."""
    z = statistics.NormalDist().inv_cdf
    seen = acceptance * (1 - NOISE) + (1 - acceptance) * NOISE  # accepted, as verdicts say
    var = seen * (1 - seen) * (1 / settings.share + 1 / (1 - settings.share))
    return round(var * (z(1 - settings.alpha) + z(1 - settings.beta)) ** 2 / WORSE_BY ** 2)


def scenario(settings: CanarySettings, incumbent: float, candidate: float, partial: float,
             trials: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    rewards = RewardMap()
    runs = [trial(settings, incumbent, candidate, partial, rewards, rng) for _ in range(trials)]
    sessions = sorted(n for _, n in runs)
    rate = {d: sum(1 for decision, _ in runs if decision == d) / trials
            for d in ("promote", "rollback", "hold")}
    return {"median_sessions": statistics.median(sessions),
            "p90_sessions": sessions[int(0.9 * (len(sessions) - 1))], **rate}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=400)
    parser.add_argument("--acceptance", type=float, default=0.4,
                        help="the incumbent's true acceptance (the demo's version 0: ~0.3)")
    parser.add_argument("--partial", type=float, default=0.35,
                        help="a failing session keeps part of its edit with this probability")
    parser.add_argument("--share", type=float, default=None)
    parser.add_argument("--alpha", type=float, default=None)
    parser.add_argument("--beta", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    chosen = {k: getattr(args, k) for k in ("share", "alpha", "beta")
              if getattr(args, k) is not None}
    settings = CanarySettings.model_validate(chosen)

    worse = scenario(settings, args.acceptance, args.acceptance - WORSE_BY, args.partial,
                     args.trials, args.seed)
    equal = scenario(settings, args.acceptance, args.acceptance, args.partial, args.trials,
                     args.seed + 1)
    fixed = fixed_horizon_sessions(settings, args.acceptance)
    print(f"canary share {settings.share}, alpha {settings.alpha}, beta {settings.beta} (per "
          f"metric), margins: acceptance {settings.acceptance.margin}, reward "
          f"{settings.reward.margin}; incumbent acceptance {args.acceptance:.0%}, "
          f"{args.trials} trials per candidate")
    for name, figures in (("10 points worse", worse), ("equal", equal)):
        print(f"  {name:>15}: promoted {figures['promote']:.1%}, rolled back "
              f"{figures['rollback']:.1%}, held {figures['hold']:.1%}; sessions median "
              f"{figures['median_sessions']:.0f}, p90 {figures['p90_sessions']}")
    print(f"  fixed-horizon z-test at the same error rates (acceptance only): {fixed} sessions")
    print(json.dumps({
        "bench": "canary", "share": settings.share, "alpha": settings.alpha,
        "beta": settings.beta, "incumbent_acceptance": args.acceptance, "trials": args.trials,
        "sessions_to_rollback_worse_10": worse["median_sessions"],
        "sessions_to_rollback_worse_10_p90": worse["p90_sessions"],
        "sessions_to_promote_equal": equal["median_sessions"],
        "sessions_to_promote_equal_p90": equal["p90_sessions"],
        "promote_worse_rate": worse["promote"], "rollback_equal_rate": equal["rollback"],
        "held_rate": max(worse["hold"], equal["hold"]),
        "fixed_horizon_sessions": fixed,
        "ratio_rollback_vs_fixed": round(worse["median_sessions"] / fixed, 3),
        "ratio_promote_vs_fixed": round(equal["median_sessions"] / fixed, 3)}))


if __name__ == "__main__":
    main()
