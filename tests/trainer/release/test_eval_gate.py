"""The eval gate's decision on per-task scores (trainer/release/eval_gate.py): the paired test, its
error rates on simulated suites, and the bare margin where a suite has no tasks."""

from __future__ import annotations

import random

import pytest

from trainer.bootstrap.config import BootstrapSettings
from trainer.release.config import HeldOutTasksEval
from trainer.release.eval_gate import HeldOutTasksSuite, Scores, gate, paired_change, t_quantile


def held_out_suite(*, max_drop_points: float = 2.0) -> HeldOutTasksSuite:
    """The held-out tasks suite the release pipeline builds; these tests hand its decision
    scores, so no model runs."""
    bootstrap = BootstrapSettings()
    return HeldOutTasksSuite(HeldOutTasksEval(max_drop_points=max_drop_points),
                             tasks=bootstrap.tasks, harness=bootstrap.harness(temperature=0.7))


def scores(per_task: list[float]) -> Scores:
    tasks = {f"t{i}": p for i, p in enumerate(per_task)}
    return Scores({"pass_at_1": sum(per_task) / len(per_task)}, tasks)


def sampled(rates: list[float], samples: int, rng: random.Random) -> Scores:
    """One evaluation: `samples` episodes per task, each passing with the task's rate."""
    return scores([sum(rng.random() < p for _ in range(samples)) / samples for p in rates])


@pytest.mark.parametrize(("q", "df", "exact"), [(0.95, 49, 1.6766), (0.975, 9, 2.2622),
                                                (0.95, 4, 2.1318), (0.99, 30, 2.4573)])
def test_t_quantile_matches_the_tables(q: float, df: int, exact: float) -> None:
    assert t_quantile(q, df) == pytest.approx(exact, abs=0.01)


def test_paired_change_is_the_mean_difference_with_its_upper_bound() -> None:
    change = paired_change({"a": 0.5, "b": 1.0, "c": 0.0}, {"a": 0.25, "b": 0.75, "c": 0.0},
                           confidence=0.95)
    assert change.mean == pytest.approx(1 / 6)
    assert change.tasks == 3 and change.upper > change.mean > 0


def test_the_same_scores_pass_and_a_clear_drop_is_refused() -> None:
    suite = held_out_suite()
    served = scores([1.0, 0.75, 0.5, 0.25, 0.0, 0.5])
    same = gate(suite, served, served)
    assert same.passed and same.change is not None and same.change.mean == 0
    worse = gate(suite, scores([0.5, 0.25, 0.0, 0.0, 0.0, 0.25]), served)
    assert not worse.passed
    assert "worse by more than the 2.0% allowed" in worse.reason
    assert worse.summary()["change"] == pytest.approx(-1 / 3)
    assert {"candidate_pass_at_1", "served_pass_at_1", "change", "change_upper",
            "change_stderr"} <= worse.summary().keys()


def test_a_drop_within_the_noise_is_not_refused() -> None:
    """One task lost, another won: no evidence of harm, which the bare 5-point margin of the
    old gate refused (pass@1 60% -> 40% on five tasks)."""
    served = scores([1.0, 1.0, 1.0, 0.0, 0.0])
    candidate = scores([1.0, 0.0, 0.0, 1.0, 0.0])
    assert gate(held_out_suite(), candidate, served).passed


def test_error_rates_on_simulated_suites() -> None:
    """50 tasks of mixed difficulty, 8 samples each: an equal candidate is refused in at most
    5% of trials (the stated rate), one 15 points worse on every task in at least 95%."""
    rng = random.Random(0)
    rates = [rng.choice([0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0]) for _ in range(50)]
    damaged = [max(0.0, p - 0.15) for p in rates]
    suite, trials = held_out_suite(), 400
    false = sum(not gate(suite, sampled(rates, 8, rng), sampled(rates, 8, rng)).passed
                for _ in range(trials))
    caught = sum(not gate(suite, sampled(damaged, 8, rng), sampled(rates, 8, rng)).passed
                 for _ in range(trials))
    assert false / trials <= 0.05
    assert caught / trials >= 0.95


def test_without_tasks_the_bare_margin_decides() -> None:
    suite = held_out_suite(max_drop_points=5.0)
    assert gate(suite, Scores({"pass_at_1": 0.56}), Scores({"pass_at_1": 0.6})).passed
    refused = gate(suite, Scores({"pass_at_1": 0.5}), Scores({"pass_at_1": 0.6}))
    assert not refused.passed and refused.change is None
    assert "worse by 10.0%, more than the 5.0% allowed" in refused.reason
