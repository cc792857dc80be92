"""The Celery app: release and sandbox jobs run as Celery tasks (app/tasks.py).

Embedded profile: a `filesystem://` broker and a `file://` result backend in folders under
the data dir, so a worker needs no server. Production: `FLYWHEEL_CELERY_BROKER_URL`
(redis://…), with results on the same Redis. Beat runs `build_release` every
`release.interval_s`.

    celery -A app.celery_app:celery_from_env worker --beat     # or make_celery(settings)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from celery import Celery

from app.settings import Settings

RELEASE_TASK = "flywheel.build_release"
ROLLBACK_TASK = "flywheel.rollback_release"
SANDBOX_TASK = "flywheel.run_sandboxed"


def _filesystem_folders(data_dir: Path) -> dict[str, Any]:
    root = (data_dir / "celery").resolve()
    queue, processed, results = root / "queue", root / "processed", root / "results"
    control = root / "control"  # kombu's default is ./control in the working directory
    for folder in (queue, processed, results, control):
        folder.mkdir(parents=True, exist_ok=True)
    return {"broker_transport_options": {"data_folder_in": str(queue),
                                         "data_folder_out": str(queue),
                                         "processed_folder": str(processed),
                                         "store_processed": False,
                                         "control_folder": str(control)},
            "result_backend": f"file://{results}"}


def make_celery(settings: Settings) -> Celery:
    """A Celery app bound to `settings` (tasks read them from `app.conf.flywheel_settings`)."""
    broker = settings.resolved_celery_broker_url
    app = Celery("flywheel", broker=broker)
    if broker.startswith("filesystem://"):
        app.conf.update(_filesystem_folders(settings.data_dir))
    else:
        app.conf.result_backend = broker if broker.startswith(("redis://", "rediss://")) \
            else f"db+{settings.resolved_database_url}"
    app.conf.update(
        task_serializer="json", result_serializer="json", accept_content=["json"],
        task_acks_late=True, worker_prefetch_multiplier=1, broker_connection_retry=True,
        broker_connection_retry_on_startup=True, result_extended=True,
        beat_schedule={"periodic-release": {
            "task": RELEASE_TASK, "schedule": settings.release.interval_s,
            "kwargs": {"requested_by": "beat", "reason": "periodic release"}}})
    app.conf.flywheel_settings = settings
    from app import tasks

    tasks.register(app)
    return app


def celery_from_env() -> Celery:
    """Entry point for the `celery` CLI: settings from FLYWHEEL_* variables."""
    return make_celery(Settings())
