"""The canary's sequential test (trainer/release/canary.py): its decisions and their error
rates on simulated sessions of known truth."""

from __future__ import annotations

import random

import pytest

from trainer.release.canary import Arm, CanarySession, CanaryTest, SequentialTest
from trainer.release.config import CanarySettings, MetricTestSettings


def feed(test: CanaryTest, rng: random.Random, incumbent: float, candidate: float,
         sessions: int, share: float = 0.5) -> str:
    """Sessions judged accept (reward 1) or reject (-1) at each arm's true rate, until a
    decision or `sessions`; returns the decision."""
    for _ in range(sessions):
        arm: Arm = "candidate" if rng.random() < share else "incumbent"
        accepted = rng.random() < (candidate if arm == "candidate" else incumbent)
        test.add(CanarySession(arm, accepted, 1.0 if accepted else -1.0))
        decision = test.decide()
        if decision != "continue":
            return decision
    return "continue"


def test_the_llr_is_walds_for_a_gaussian_difference() -> None:
    test = SequentialTest(MetricTestSettings(margin=0.1, min_variance=1e-6), alpha=0.05,
                          beta=0.05, min_sessions=2)
    for arm, outcomes in (("incumbent", [1, 0, 1, 0]), ("candidate", [1, 1, 1, 0])):
        for x in outcomes:
            test.add(arm, float(x))  # type: ignore[arg-type]
    diff, var = test.difference()
    assert diff == pytest.approx(0.25)
    assert var == pytest.approx(1 / 3 / 4 + 1 / 4 / 4)  # sample variances over n
    # log N(D; 0, V) - log N(D; -margin, V)
    expected = (-(diff ** 2) + (diff + 0.1) ** 2) / (2 * var)
    assert test.llr() == pytest.approx(expected)


def test_no_decision_before_each_arm_has_its_minimum() -> None:
    test = CanaryTest(CanarySettings(min_sessions=50))
    for _ in range(49):
        test.add(CanarySession("incumbent", True, 1.0))
        test.add(CanarySession("candidate", False, -1.0))
    assert test.decide() == "continue"
    test.add(CanarySession("incumbent", True, 1.0))
    test.add(CanarySession("candidate", False, -1.0))
    assert test.decide() == "rollback"


def test_a_decided_metric_keeps_its_decision() -> None:
    test = CanaryTest(CanarySettings(min_sessions=5))
    for _ in range(30):  # acceptance much worse: rolled back
        test.add(CanarySession("incumbent", True, 1.0))
        test.add(CanarySession("candidate", False, 1.0))
    assert test.decide() == "rollback"
    for _ in range(3000):  # then far better: the decision stands
        test.add(CanarySession("candidate", True, 1.0))
    assert test.decide() == "rollback"
    assert test.figures()["acceptance"]["decision"] == "rollback"


def test_an_undecided_candidate_is_held_at_the_deadline() -> None:
    settings = CanarySettings(max_sessions=200, min_sessions=10)
    test = CanaryTest(settings)
    # exactly halfway between equal and worse by the margin: the LLR stays near 0
    decision = "continue"
    for i in range(400):
        test.add(CanarySession("incumbent", i % 20 < 11, 0.0))
        test.add(CanarySession("candidate", i % 20 < 10, 0.0))
        decision = test.decide()
        if decision != "continue":
            break
    assert decision == "hold"
    assert test.tests["acceptance"].arms["candidate"].n == 200


@pytest.mark.parametrize(("candidate", "right"), [(0.30, "rollback"), (0.40, "promote")])
def test_error_rates_hold_on_simulated_truth(candidate: float, right: str) -> None:
    """200 canaries of a candidate 10 points worse (or equal) than a 40% incumbent at the
    defaults' 5% error rates: the wrong decision in at most 10% of them (the binomial's
    99.9% bound on 200 trials at 5% is 14 wrong; 20 leaves room for Wald's approximation),
    and every canary decides."""
    settings = CanarySettings(share=0.5)
    rng = random.Random(7)
    decisions = [feed(CanaryTest(settings), rng, 0.40, candidate, 20_000) for _ in range(200)]
    wrong = sum(d not in (right, "continue", "hold") for d in decisions)
    assert decisions.count("continue") == 0
    assert wrong <= 20
    assert decisions.count(right) >= 170
