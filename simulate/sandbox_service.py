"""The sandbox as a service: jobs run as the Celery sandbox task on a separate sandbox fleet.

Rollout workers score every tool call and every episode in a sandbox. By default that is the
local one (`simulate.sandbox.run_sandboxed`, a forked child per job). With a Celery broker URL
(Redis) the jobs go to the `SANDBOX_QUEUE` queue instead, where `celery worker -Q
flywheel-sandbox` processes on any host run them, so the sandbox fleet scales apart from the
rollout workers (code execution is CPU-bound and untrusted; decoding is neither).

    run = sandbox_runner("redis://sandbox-redis:6379/0")   # or None: the local sandbox
    result = run(job)

    # a sandbox host (no torch imported):
    celery -A app.jobs.celery_app:celery_from_env worker -Q flywheel-sandbox
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from simulate.sandbox import SandboxJob, SandboxResult, run_sandboxed

SANDBOX_TASK = "flywheel.run_sandboxed"  # registered by app/jobs/celery_app.py
SANDBOX_QUEUE = "flywheel-sandbox"

SandboxRunner = Callable[[SandboxJob], SandboxResult]


class SandboxServiceError(RuntimeError):
    """The sandbox fleet did not answer a job in time (no result is a verdict on the code)."""


class CelerySandbox:
    """A client of the Celery sandbox task: `send_task` by name, so the caller imports no app;
    results on the broker's Redis, forgotten once read."""

    def __init__(self, broker_url: str, *, queue: str = SANDBOX_QUEUE,
                 timeout_s: float = 300.0) -> None:
        from celery import Celery

        self.queue = queue
        self.timeout_s = timeout_s
        self.app = Celery("flywheel-sandbox-client", broker=broker_url, backend=broker_url)
        self.app.conf.update(task_serializer="json", result_serializer="json",
                             accept_content=["json"], broker_connection_retry_on_startup=True)

    def __call__(self, job: SandboxJob) -> SandboxResult:
        pending = self.app.send_task(SANDBOX_TASK, kwargs={"job": job.model_dump(mode="json")},
                                     queue=self.queue)
        try:
            answer: dict[str, Any] = pending.get(timeout=self.timeout_s)
        except Exception as exc:  # celery raises its own TimeoutError and the task's errors
            raise SandboxServiceError(
                f"sandbox task {pending.id} on {self.queue!r}: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            pending.forget()
        return SandboxResult.model_validate(answer)

    def close(self) -> None:
        self.app.close()


def sandbox_runner(broker_url: str | None, *, queue: str = SANDBOX_QUEUE) -> SandboxRunner:
    """The local sandbox (None), or the Celery sandbox fleet behind `broker_url`."""
    return run_sandboxed if broker_url is None else CelerySandbox(broker_url, queue=queue)
