"""Celery tasks: the release pipeline and sandboxed execution, JSON in and out.

`register(app)` binds them to one Celery app (`app.celery_app.make_celery`), whose
`conf.flywheel_settings` they read; the work itself lives in app/releases.py and
simulate/sandbox.py, so each task is a thin wrapper.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from celery import Celery

from app.settings import Settings


@contextlib.contextmanager
def release_context(settings: Settings) -> Iterator[Any]:
    """Open the DB and a producer on `releases` for one task run."""
    from app.db import make_db_engine
    from app.releases import ReleaseContext
    from ingest.log import EventProducer

    if settings.kafka_bootstrap is None:
        raise RuntimeError("settings.kafka_bootstrap is unset: the release worker needs Kafka")
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    db = make_db_engine(settings.resolved_database_url)
    producer = EventProducer(settings.kafka_config(settings.kafka_bootstrap),
                             client_id="flywheel-release")
    try:
        yield ReleaseContext(settings=settings, db=db, producer=producer)
    finally:
        producer.close()
        db.dispose()


def run_release(settings: Settings, *, version: int | None = None,
                candidate: str | None = None, requested_by: str = "system",
                reason: str = "") -> dict[str, Any]:
    from app.releases import build_release

    with release_context(settings) as ctx:
        release = build_release(ctx, candidate=Path(candidate) if candidate else None,
                                version=version, requested_by=requested_by, reason=reason)
        return release.model_dump(mode="json")


def register(app: Celery) -> None:
    # shared=False: each app's tasks close over that app's settings; a shared task would be
    # registered on every later app too and run with the first app's settings.
    from app.celery_app import RELEASE_TASK, ROLLBACK_TASK, SANDBOX_TASK

    def settings() -> Settings:
        return app.conf.flywheel_settings  # type: ignore[no-any-return]

    @app.task(name=RELEASE_TASK, shared=False)
    def build_release_task(version: int | None = None, candidate: str | None = None,
                           requested_by: str = "system", reason: str = "") -> dict[str, Any]:
        return run_release(settings(), version=version, candidate=candidate,
                           requested_by=requested_by, reason=reason)

    @app.task(name=ROLLBACK_TASK, shared=False)
    def rollback_task(version: int, requested_by: str = "admin",
                      reason: str = "") -> dict[str, Any]:
        from app.releases import rollback_release

        with release_context(settings()) as ctx:
            return rollback_release(ctx, version, requested_by=requested_by,
                                    reason=reason).model_dump(mode="json")

    @app.task(name=SANDBOX_TASK, shared=False)
    def run_sandboxed_task(job: dict[str, Any]) -> dict[str, Any]:
        from simulate.sandbox import SandboxJob, run_sandboxed

        return run_sandboxed(SandboxJob.model_validate(job)).model_dump(mode="json")
