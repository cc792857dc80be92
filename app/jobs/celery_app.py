"""The Celery app: release and sandbox jobs as Celery tasks, each a thin wrapper (JSON in and
out) around trainer/release/pipeline.py or simulate/sandbox.py.

Embedded profile: a `filesystem://` broker and a `file://` result backend in folders under
the data dir, so a worker needs no server, and the API process runs that worker itself
(`EmbeddedWorker`: solo pool and beat on a thread, started and stopped with the app), so
`flywheel up` runs what `POST /admin/releases` and beat queue. Production:
`FLYWHEEL_CELERY_BROKER_URL` (redis://…), with results on the same Redis, and workers are
separate processes. Beat runs `build_release` every `release.interval_s`. Rollout workers
send sandbox jobs to their own queue (`simulate/sandbox_service.py`), which a sandbox fleet
consumes apart from the release worker.

    celery -A app.jobs.celery_app:celery_from_env worker --beat     # or make_celery(settings)
    celery -A app.jobs.celery_app:celery_from_env worker -Q flywheel-sandbox    # a sandbox host
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path
from typing import Any

from celery import Celery

from app.settings import Settings
from simulate.sandbox_service import SANDBOX_TASK

log = logging.getLogger(__name__)

RELEASE_TASK = "flywheel.build_release"


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
    """A Celery app bound to `settings`, its tasks registered."""
    broker = settings.resolved_celery_broker_url
    app = Celery("flywheel", broker=broker)
    if broker.startswith("filesystem://"):
        app.conf.update(_filesystem_folders(settings.data_dir),
                        broker_transport="app.jobs.celery_fs:AtomicFilesystemTransport")
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
    register_tasks(app, settings)
    return app


def register_tasks(app: Celery, settings: Settings) -> None:
    """The tasks, bound to `app` and `settings`. trainer/release/pipeline.py (and torch with it) is
    imported by the first release or rollback a worker runs: a sandbox worker never does."""
    # shared=False: each app's tasks close over that app's settings; a shared task would be
    # registered on every later app too and run with the first app's settings.

    @app.task(name=RELEASE_TASK, shared=False)
    def build_release_task(version: int | None = None, candidate: str | None = None,
                           requested_by: str = "system", reason: str = "") -> dict[str, Any]:
        from trainer.release.pipeline import build_release, open_release_context

        with open_release_context(settings.release_config()) as ctx:
            return build_release(ctx, candidate=Path(candidate) if candidate else None,
                                 version=version, requested_by=requested_by,
                                 reason=reason).model_dump(mode="json")

    @app.task(name=SANDBOX_TASK, shared=False)
    def run_sandboxed_task(job: dict[str, Any]) -> dict[str, Any]:
        from simulate.sandbox import SandboxJob, run_sandboxed

        return run_sandboxed(SandboxJob.model_validate(job)).model_dump(mode="json")


def celery_from_env() -> Celery:
    """Entry point for the `celery` CLI: settings from FLYWHEEL_* variables."""
    return make_celery(Settings())


class EmbeddedWorker:
    """A Celery worker (solo pool, one task at a time) and beat, on threads of this process:
    the embedded profile's release worker. `stop` is a warm shutdown (the task in progress
    finishes first). Beat runs as a thread, not Celery's default forked process."""

    def __init__(self, app: Celery, data_dir: Path) -> None:
        from celery.beat import EmbeddedService

        self.worker = app.WorkController(
            pool="solo", concurrency=1, loglevel="WARNING",
            hostname=f"flywheel-embedded-{os.getpid()}@{socket.gethostname()}",
            without_heartbeat=True, without_mingle=True, without_gossip=True)
        self.beat = EmbeddedService(
            app, thread=True,
            schedule_filename=str((data_dir / "celery" / "beat-schedule").resolve()))
        self.thread = threading.Thread(target=self._run, name="celery-worker", daemon=True)

    def _run(self) -> None:
        # The solo pool traces tasks with `current_app`: make it this app, in this thread and
        # as the process default (the API process holds one Celery app).
        self.worker.app.set_current()
        self.worker.app.set_default()
        try:
            self.worker.start()
        except Exception:  # the thread's only report: the API keeps serving without it
            log.exception("embedded Celery worker stopped")

    def start(self) -> EmbeddedWorker:
        self.thread.start()
        self.beat.start()
        return self

    def stop(self, timeout_s: float = 120.0) -> None:
        from celery.worker import state

        self.beat.stop()
        # what a worker's SIGTERM handler sets: finish, then exit (celery 5 has no public call
        # that stops an in-process worker from another thread; tests/test_library_seams.py)
        state.should_stop = 0
        self.thread.join(timeout=timeout_s)
        state.should_stop = None  # a later embedded worker in this process must not stop
        if self.thread.is_alive():
            log.warning("embedded Celery worker still busy after %.0f s", timeout_s)


def start_release_worker(settings: Settings, app: Celery) -> EmbeddedWorker | None:
    """With the embedded broker, run the release tasks and beat in this process; with a
    Redis broker, `celery worker --beat` processes do (None)."""
    if not settings.resolved_celery_broker_url.startswith("filesystem://"):
        return None
    return EmbeddedWorker(app, settings.data_dir).start()
