"""The production profile of Celery: a real worker (a thread here, `celery worker` in
production) on Redis runs the sandbox task and a release build, JSON in and out.

Skips without Redis at 127.0.0.1:6379, fails instead when CI=true.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from sqlmodel import Session

from app.db import make_db_engine
from app.jobs.celery_app import RELEASE_TASK, SANDBOX_TASK, make_celery
from app.settings import Settings
from ingest.events import ReleasePublished
from ingest.topic_reader import read_all
from simulate.sandbox import SandboxJob, SandboxResult
from tests.conftest import require_service
from tests.trainer.helpers import make_checkpoint
from trainer.release.config import HeldOutLossEval
from trainer.release.pipeline import Release

pytestmark = pytest.mark.integration
REDIS = "redis://127.0.0.1:6379/0"


def test_worker_on_redis_runs_sandbox_and_release(settings: Settings, tmp_path: Path,
                                                  model_dir: Path) -> None:
    require_service("Redis", "127.0.0.1", 6379)
    from celery.contrib.testing.worker import start_worker

    settings = settings.model_copy(update={
        "celery_broker_url": REDIS, "release": settings.release.model_copy(update={
            "eval": HeldOutLossEval(sequences=2, seq_len=64)})})
    celery = make_celery(settings)
    assert celery.conf.result_backend == REDIS
    celery.conf.task_default_queue = f"flywheel-test-{uuid.uuid4().hex[:8]}"  # test-private
    make_checkpoint(model_dir, tmp_path / "ckpt.safetensors", scale=1e-3, seed=5)
    job = SandboxJob(code="def f(x):\n    return x + 1\n",
                     tests="assert f(1) == 2\nassert f(-1) == 0\n")
    with start_worker(celery, pool="solo", perform_ping_check=False, shutdown_timeout=30):
        sandboxed = celery.send_task(SANDBOX_TASK, kwargs={"job": job.model_dump(mode="json")})
        release = celery.send_task(RELEASE_TASK, kwargs={
            "candidate": str(tmp_path / "ckpt.safetensors"), "requested_by": "redis-test"})
        result = SandboxResult.model_validate(sandboxed.get(timeout=120))
        row = release.get(timeout=120)

    assert result.status == "passed", result
    assert (row["version"], row["status"], row["requested_by"]) == (1, "published", "redis-test")
    db = make_db_engine(settings.resolved_database_url)
    with Session(db) as session:
        assert session.get(Release, 1).sha256 == row["sha256"]  # type: ignore[union-attr]
    db.dispose()
    events = read_all(settings.kafka_config(settings.kafka_bootstrap or ""),
                      settings.topics.releases, ReleasePublished)
    assert sorted((e.version, e.kind) for e in events) == [(0, "snapshot"), (1, "delta")]


def test_rollout_tool_calls_run_on_the_sandbox_fleet(tmp_path: Path) -> None:
    """An episode's `run_tests` and its score go to a sandbox worker over Redis (its own
    queue, as `celery worker -Q flywheel-sandbox` hosts take them); with nobody on the queue
    the call fails with a clear error instead of a verdict."""
    require_service("Redis", "127.0.0.1", 6379)
    from celery.contrib.testing.worker import start_worker

    from simulate.rollouts import SandboxCache, TaskEnvironment
    from simulate.sandbox_service import CelerySandbox, SandboxServiceError
    from simulate.tasks import BuiltinTaskSource
    from simulate.tools import ToolCall

    task = BuiltinTaskSource(held_out_fraction=0.0).tasks()[0]
    queue = f"flywheel-sandbox-test-{uuid.uuid4().hex[:8]}"
    unanswered = CelerySandbox(REDIS, queue=f"{queue}-nobody", timeout_s=2)
    with pytest.raises(SandboxServiceError, match="nobody"):
        unanswered(task.sandbox_job(task.canonical_solution))
    unanswered.close()

    sandbox_host = make_celery(Settings(data_dir=tmp_path / "sandbox-host",
                                        celery_broker_url=REDIS))
    runner = CelerySandbox(REDIS, queue=queue)
    env = TaskEnvironment(task, tmp_path / "w", SandboxCache(runner))
    with start_worker(sandbox_host, pool="solo", perform_ping_check=False, queues=[queue],
                      shutdown_timeout=30):
        (obs,), _ = env.step([ToolCall("write_file", {
            "path": "solution.py", "content": f"{task.prompt}{task.canonical_solution}"})])
        assert "wrote" in obs
        (obs,), _ = env.step([ToolCall("run_tests")])
        assert obs.startswith("passed"), obs
        assert env.step([ToolCall("finish")])[1] and env.reward().value == 1.0
    assert env.cache.misses >= 1
    runner.close()
