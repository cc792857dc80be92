"""The canary's decision: is the candidate, served to a share of sessions, no worse than the
incumbent on live traffic? A sequential test that looks after every verdict.

The unit is a session (the sticky unit of assignment); its outcome is a number per metric
(acceptance: 1 when the session was accepted, else 0; reward: the verdict's reward). For each
metric, `SequentialTest` is Wald's SPRT on the difference of the arms' means d = candidate -
incumbent in its Gaussian (Brownian motion) form: with the estimate D and its variance V
(each arm's sample variance over its sessions), the information is I = 1/V and the
log-likelihood ratio of "equal" (d = 0) against "worse by the margin" (d = -margin) is

    LLR = margin * I * (D + margin / 2)

It promotes once LLR >= log((1 - beta) / alpha) and rolls back once LLR <= log(beta / (1 -
alpha)): a candidate worse by the margin is promoted with probability at most about alpha, an
equal one rolled back with probability at most about beta (Wald's bounds; the overshoot of a
boundary between looks makes both a little smaller). In between it waits for more sessions,
and a candidate whose arm reaches `max_sessions` without a decision is held (it keeps its
share; an admin decides). `bench/canary.py` measures both error rates and the sessions each
decision takes against a simulation's truth.

Several metrics: the candidate is rolled back when any test rolls it back and promoted when
every test has promoted it; a test that has decided keeps its decision. So P(promote | worse)
stays within the smallest alpha, and P(roll back | equal) within the sum of the betas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from trainer.release.config import CanarySettings, MetricTestSettings

Decision = Literal["continue", "promote", "rollback", "hold"]
Arm = Literal["incumbent", "candidate"]


@dataclass
class Moments:
    """Count, mean and sum of squared deviations of one arm's outcomes (Welford)."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)

    def variance(self, floor: float) -> float:
        return max(floor, self.m2 / (self.n - 1)) if self.n > 1 else max(floor, 0.25)


@dataclass
class SequentialTest:
    """Wald's SPRT for "candidate equal" against "candidate worse by `margin`" on one metric."""

    settings: MetricTestSettings
    alpha: float
    beta: float
    min_sessions: int
    arms: dict[str, Moments] = field(default_factory=lambda: {"incumbent": Moments(),
                                                              "candidate": Moments()})
    decision: Decision = "continue"

    def add(self, arm: Arm, outcome: float) -> None:
        self.arms[arm].add(outcome)

    def difference(self) -> tuple[float, float]:
        """(candidate mean - incumbent mean, its variance)."""
        inc, cand = self.arms["incumbent"], self.arms["candidate"]
        floor = self.settings.min_variance
        var = (cand.variance(floor) / max(1, cand.n)) + (inc.variance(floor) / max(1, inc.n))
        return cand.mean - inc.mean, var

    def llr(self) -> float:
        diff, var = self.difference()
        margin = self.settings.margin
        return margin * (diff + margin / 2) / var

    def update(self) -> Decision:
        """Decide once both arms have `min_sessions`; a decision, once made, stays."""
        if self.decision != "continue":
            return self.decision
        if min(a.n for a in self.arms.values()) < self.min_sessions:
            return self.decision
        llr = self.llr()
        if llr >= math.log((1 - self.beta) / self.alpha):
            self.decision = "promote"
        elif llr <= math.log(self.beta / (1 - self.alpha)):
            self.decision = "rollback"
        return self.decision

    def figures(self, z: float = 1.96) -> dict[str, float]:
        """Both arms' means and counts, the difference with its 95% interval, the LLR."""
        diff, var = self.difference()
        half = z * math.sqrt(var)
        return {"incumbent_mean": self.arms["incumbent"].mean,
                "incumbent_sessions": self.arms["incumbent"].n,
                "candidate_mean": self.arms["candidate"].mean,
                "candidate_sessions": self.arms["candidate"].n,
                "difference": diff, "low": diff - half, "high": diff + half,
                "llr": self.llr()}


@dataclass(frozen=True)
class CanarySession:
    """One judged session of either arm: accepted or not, and its reward."""

    arm: Arm
    accepted: bool
    reward: float


class CanaryTest:
    """The tests of every metric over one candidate's canary; `add` a judged session, then
    `decide`."""

    def __init__(self, settings: CanarySettings) -> None:
        self.settings = settings
        self.tests = {name: SequentialTest(getattr(settings, name), settings.alpha,
                                           settings.beta, settings.min_sessions)
                      for name in ("acceptance", "reward")}

    def add(self, outcome: CanarySession) -> None:
        self.tests["acceptance"].add(outcome.arm, float(outcome.accepted))
        self.tests["reward"].add(outcome.arm, outcome.reward)

    def decide(self) -> Decision:
        decisions = [test.update() for test in self.tests.values()]
        if "rollback" in decisions:
            return "rollback"
        if all(d == "promote" for d in decisions):
            return "promote"
        if self.tests["acceptance"].arms["candidate"].n >= self.settings.max_sessions:
            return "hold"
        return "continue"

    def figures(self) -> dict[str, dict[str, float | str]]:
        return {name: {**test.figures(), "decision": test.decision}
                for name, test in self.tests.items()}
