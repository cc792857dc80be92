"""Simulated developers: their verdicts, and real agent sessions against the running stack."""

from __future__ import annotations

import asyncio

from pydantic import SecretStr

from app.cli.stack import running_stack
from app.settings import Settings
from ingest.events import FeedbackReceived, GenerationLogged
from ingest.topic_reader import read_all
from simulate.developers import (
    DeveloperPopulation,
    DeveloperSettings,
    verdict,
    version_of,
    with_noise,
)
from simulate.harness import HarnessConfig
from simulate.tasks import BuiltinTasksConfig, build_task_source


def test_verdict_follows_the_hidden_tests_and_the_anti_cheat_checks() -> None:
    assert verdict(1.0, []) == ("accept", None)
    assert verdict(0.5, []) == ("edit_kept", 0.5)
    assert verdict(0.0, []) == ("reject", None)
    assert verdict(1.0, ["special-cased expected outputs"]) == ("reject", None)


def test_noise_flips_a_verdict() -> None:
    assert with_noise("accept", None, True) == ("reject", None)
    assert with_noise("reject", None, True) == ("accept", None)
    assert with_noise("edit_kept", 0.75, True) == ("reject", None)
    assert with_noise("edit_kept", 0.25, False) == ("edit_kept", 0.25)
    assert version_of("fw-v12-0123456789ab") == 12


def test_developers_run_agent_sessions_over_http_and_judge_them(settings: Settings) -> None:
    """Each session is several chat completions under one session_id (the harness's turns),
    and one signed verdict names the whole session."""
    settings = settings.model_copy(update={"feedback_secrets": [SecretStr("dev-secret")]})
    tasks = build_task_source(BuiltinTasksConfig()).split("product")[:4]
    developers = DeveloperSettings(concurrency=2, noise=0.0, max_delay_s=0.05,
                                   harness=HarnessConfig(max_turns=2, max_tokens=12))
    with running_stack(settings) as stack:
        population = DeveloperPopulation(stack.base_url, tasks, secret="dev-secret",
                                         settings=developers, workdir=settings.data_dir)
        asyncio.run(population.run(until=lambda: population.stats.sessions >= 4))
        sessions = read_all(stack.kafka, stack.kafka.topics.sessions, GenerationLogged)
        feedback = read_all(stack.kafka, stack.kafka.topics.feedback, FeedbackReceived)
        # a session that fills the model's context: the server's context_length_exceeded
        # ends the agent's episode by its context, judged, not a failed request
        long = DeveloperSettings(concurrency=1, noise=0.0, max_delay_s=0.05,
                                 harness=HarnessConfig(max_turns=100, max_tokens=256,
                                                       max_summaries=0))
        filled = DeveloperPopulation(stack.base_url, tasks[:1], secret="dev-secret",
                                     settings=long, workdir=settings.data_dir)
        asyncio.run(filled.run(until=lambda: filled.stats.sessions >= 1))
    assert filled.stats.failed_requests == 0 and filled.stats.feedback_sent == 1
    stats = population.stats
    assert stats.failed_requests == 0 and stats.feedback_sent == stats.sessions >= 4
    assert stats.by_version[0].sessions == stats.sessions  # one version served them all
    outcomes = {o.session_id: o for o in population.outcomes}
    by_session: dict[str, int] = {}
    for g in sessions:
        by_session[g.session_id or ""] = by_session.get(g.session_id or "", 0) + 1
    assert {s: len(o.versions) for s, o in outcomes.items()} == by_session
    assert all(1 <= turns <= 2 for turns in by_session.values())
    assert {f.session_id for f in feedback} == set(outcomes) and all(
        f.generation_id is None and f.kind in ("accept", "reject", "edit_kept")
        for f in feedback)
    # the random tiny model solves nothing: every verdict is a reject
    assert {f.kind for f in feedback} == {"reject"}
