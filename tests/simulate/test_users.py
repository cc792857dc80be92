"""Simulated users: the hidden preference, and a real session against the running stack."""

from __future__ import annotations

from pathlib import Path

from pydantic import SecretStr

from app.settings import Settings
from app.stack import running_stack
from ingest.events import FeedbackReceived
from ingest.log import read_all
from simulate.users import StartsWith, UserPopulation, aligned_prefix_preference


def test_starts_with() -> None:
    pref = StartsWith(("def", " ("))
    assert pref.accepts("def f():") and pref.accepts(" (x)")
    assert not pref.accepts("class A:") and not pref.accepts("")


def test_aligned_preference_is_rare_under_the_base_model(model_dir: Path) -> None:
    pref = aligned_prefix_preference(model_dir, size=100)
    assert len(pref.prefixes) == 100 and all(p.strip() for p in pref.prefixes)
    assert aligned_prefix_preference(model_dir, size=100) == pref  # seeded: stable


def test_population_calls_the_endpoint_and_sends_signed_feedback(settings: Settings) -> None:
    settings = settings.model_copy(update={"feedback_secrets": [SecretStr("sim-secret")]})
    with running_stack(settings) as stack:
        users = UserPopulation(stack.base_url, preference=StartsWith(("",)), secret="sim-secret",
                               max_delay_s=0.05, noise=0.0)
        stats = users.run(requests=6, concurrency=2)
        users.close()
        feedback = read_all(stack.kafka, stack.kafka.topics.feedback, FeedbackReceived)
    assert stats.failed_requests == 0 and stats.feedback_sent == 6
    assert sum(s.served for s in stats.by_version.values()) == 6
    assert list(stats.acceptance().values()) == [1.0]  # "" prefixes every completion
    assert {f.kind for f in feedback} == {"accept"} and len(feedback) == 6
