"""The demo's simulated developers in a process of their own, as real users' editors are other
machines: their sessions' Python (the openai client, the agent harness, the sandboxed tool
calls) does not share the API's interpreter lock with the engine's decode loop.

The process (`run_developers`) sends each session's outcome back over a queue as it ends, and
its counts of requests and verdicts when it stops; `DeveloperProcess` mirrors them in a
`DeveloperRecord` that the live view and the report read (`stats`, `outcomes`).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import time
from dataclasses import dataclass, field
from typing import Any

from app.settings import Settings
from simulate.developers import PopulationStats, SessionOutcome

# the counts only the developers' process knows (requests that failed, verdicts sent)
FINAL_COUNTS = ("failed_requests", "failures", "feedback_sent", "feedback_failed")


@dataclass
class DeveloperRecord:
    """What the developers did, as far as their process has told: every finished session and
    the counts over them (`PopulationStats`, the same as the population's own)."""

    stats: PopulationStats = field(default_factory=PopulationStats)
    outcomes: list[SessionOutcome] = field(default_factory=list)

    def record(self, outcome: SessionOutcome) -> None:
        self.stats.record(outcome)
        self.outcomes.append(outcome)


def run_developers(settings_json: str, secret: str, base_url: str, concurrency: int,
                   temperature: float, out: Any, stop: Any) -> None:
    """The process body: the developer population on the product tasks until `stop` is set;
    ("session", outcome) for each session as it ends, then ("counts", {...}) or ("error", ...).
    """
    from simulate.developers import DeveloperPopulation, DeveloperSettings
    from simulate.tasks import build_task_source

    settings = Settings.model_validate_json(settings_json)
    try:
        population = DeveloperPopulation(
            base_url, build_task_source(settings.bootstrap.tasks).split("product"),
            secret=secret, settings=DeveloperSettings(
                concurrency=concurrency,
                harness=settings.bootstrap.harness(temperature=temperature)),
            workdir=settings.data_dir)
        asyncio.run(population.run(until=stop.is_set,
                                   on_session=lambda o: out.put(("session", o))))
    except BaseException as exc:  # the demo reports it and stops
        out.put(("error", f"{type(exc).__name__}: {exc}"))
        raise
    out.put(("counts", {name: getattr(population.stats, name) for name in FINAL_COUNTS}))


class DeveloperProcess:
    """`run_developers` in a spawned process; `poll` takes in what it has sent so far."""

    def __init__(self, settings: Settings, base_url: str, *, concurrency: int,
                 temperature: float) -> None:
        context = multiprocessing.get_context("spawn")
        self.population = DeveloperRecord()
        self.error: BaseException | None = None
        self.finished = False
        self.queue = context.Queue()
        self.stop = context.Event()
        # the signing secret travels apart: the settings' JSON masks it
        secret = settings.feedback_secrets[0].get_secret_value()
        self.process = context.Process(
            target=run_developers, name="developers", daemon=True,
            args=(settings.model_dump_json(), secret, base_url, concurrency, temperature,
                  self.queue, self.stop))

    def poll(self, timeout_s: float = 0.0) -> None:
        """Take in every message waiting (waiting up to `timeout_s` for the first)."""
        block = timeout_s > 0
        while not self.finished:
            try:
                kind, body = self.queue.get(block=block, timeout=timeout_s if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "session":
                self.population.record(body)
            elif kind == "counts":
                for name, value in body.items():
                    setattr(self.population.stats, name, value)
                self.finished = True
            else:
                self.error = RuntimeError(f"the simulated developers stopped: {body}")
                self.finished = True

    def __enter__(self) -> DeveloperProcess:
        self.process.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop them: every started session finishes and sends its verdict first."""
        self.stop.set()
        deadline = time.monotonic() + 300
        while not self.finished and time.monotonic() < deadline:
            self.poll(timeout_s=1.0)
            if not self.process.is_alive() and self.queue.empty():
                break
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
