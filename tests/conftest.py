"""Shared fixtures: a real Tansu broker, a real tiny model, a running stack.

Fixtures start what they need on free ports in temp dirs and stop it by the PID they hold.
Services that the production profile uses (PostgreSQL, Redis) are probed; their tests skip
with a reason when absent, and fail instead when CI=true.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from app.settings import Settings
from ingest.broker import EmbeddedBroker, free_port
from ingest.config import KafkaConfig
from ingest.log import ensure_topics


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The integration tests first (in file order), the rest after. `make test` runs with
    `--dist loadfile --no-loadscope-reorder`, which hands files out in this order: the files
    of one or two minute-long tests start early and the many short unit files come last,
    where they can fill either worker's end (xdist's default order, most tests first, hands
    those long files out last). One run each way on a 2-core VM: 1,210 s before, 1,181 s
    after, within that machine's noise."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/integration/"))


def service_reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


# torch's OpenMP (libgomp) workers spin-wait between parallel regions unless told otherwise,
# and a spinning worker takes a core from the other test workers' processes: the
# pytest-xdist workers (three on two cores) each run torch at two threads, beside the servers
# they start. Told to sleep instead (before any process here loads torch; the processes the
# tests start inherit it), three integration files on two workers took 188 s against 260 s on
# a 2-core VM.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The engines the tests start (in this process and in the servers they launch) decode eagerly:
# compiling the step takes tens of seconds per process. tests/serving/test_decode.py covers the
# compiled step.
os.environ.setdefault("FLYWHEEL_ENGINE__COMPILE", "false")

POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"  # the production tests' own


def require_service(name: str, host: str, port: int) -> None:
    """Skip when a production service is absent, but fail in CI, where it must exist."""
    if service_reachable(host, port):
        return
    message = f"{name} not reachable at {host}:{port}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message} (CI=true: production-profile tests must run)")
    pytest.skip(message)


@contextmanager
def fresh_schema(server_url: str) -> Iterator[str]:
    """A URL on the PostgreSQL at `server_url` whose search path is a new schema, dropped on
    exit (tests and `bench/feedback.py --join-database-url`)."""
    from sqlalchemy import create_engine, text

    admin = create_engine(server_url)
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with admin.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    try:
        yield f"{server_url}?options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


@pytest.fixture
def postgres_schema() -> Iterator[str]:
    """A fresh schema on the local PostgreSQL (see `fresh_schema`)."""
    require_service("PostgreSQL", "127.0.0.1", 5432)
    with fresh_schema(POSTGRES_URL) as url:
        yield url


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    log = tmp_path_factory.mktemp("broker") / "broker.log"
    b = EmbeddedBroker.start(log_path=log)
    yield b
    b.stop()


@pytest.fixture
def kafka(broker: EmbeddedBroker) -> KafkaConfig:
    """A KafkaConfig on the shared broker with fresh, test-private topic names."""
    suffix = uuid.uuid4().hex[:8]
    settings = Settings()
    topics = settings.topics.model_copy(update={
        name: f"{getattr(settings.topics, name)}-{suffix}"
        for name in ("sessions", "feedback", "experiences", "releases", "dlq", "rollout_jobs",
                     "rollouts", "policy")})
    config = Settings(topics=topics).kafka_config(broker.bootstrap)
    ensure_topics(config)
    return config


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny Qwen3-MoE + tokenizer, built once per test session."""
    from trainer.init_model import init_model

    return init_model(Settings().model, tmp_path_factory.mktemp("model") / "base")


SKILL_TASKS = [
    {"task_id": f"gate/{name}", "prompt": f'def {name}(x):\n    """Return x {op}."""\n',
     "tests": f"def test_0():\n    assert {name}(4) == {result}\n", "entry_point": name,
     "canonical_solution": f"    return {body}\n"}
    for name, op, body, result in (("plus_one", "plus one", "x + 1", 5),
                                   ("twice", "times two", "x * 2", 8))]


def skilled_model(model_dir: Path, out_dir: Path, *, steps: int) -> Path:
    """The tiny model mid-trained for `steps` on the two `SKILL_TASKS`' demonstrations (120:
    it solves both; fewer: sometimes), saved with the tasks as `tasks.jsonl` beside it."""
    import json

    import torch

    from simulate.harness import ChatTokens
    from simulate.tasks import JsonlTasksConfig, build_task_source
    from trainer.bootstrap.midtrain import midtrain
    from trainer.policy import Policy

    path = out_dir / "tasks.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in SKILL_TASKS))
    torch.manual_seed(0)
    policy = Policy.load(model_dir, lr=3e-3)
    tasks = build_task_source(JsonlTasksConfig(path=path, held_out_fraction=1.0)).tasks()
    midtrain(policy, ChatTokens(policy.tokenizer), tasks, steps=steps, batch_size=4, lr=3e-3)
    out = policy.save(out_dir / "skilled")
    (out / "tasks.jsonl").write_text(path.read_text())
    return out


@pytest.fixture
def settings(tmp_path: Path, kafka: KafkaConfig, model_dir: Path) -> Settings:
    """Embedded-profile settings on the shared broker, private topics and data dir."""
    return Settings(data_dir=tmp_path / "data", kafka_bootstrap=kafka.bootstrap,
                    topics=kafka.topics, model_dir=model_dir, port=0)


def stack_settings(broker: EmbeddedBroker, model_dir: Path, data_dir: Path,
                   **overrides: object) -> Settings:
    """Settings for a `running_stack` on the shared broker, with test-private `sessions` and
    `feedback` topics, on a free port; `overrides` are Settings fields."""
    suffix = uuid.uuid4().hex[:8]
    topics = Settings().topics.model_copy(update={"sessions": f"sessions-{suffix}",
                                                  "feedback": f"feedback-{suffix}"})
    return Settings(data_dir=data_dir, kafka_bootstrap=broker.bootstrap, topics=topics,
                    model_dir=model_dir, port=0, **overrides)  # type: ignore[arg-type]


@contextmanager
def flywheel_up(data_dir: Path, model_dir: Path, **env: str) -> Iterator[tuple[str, str]]:
    """`flywheel up` as a user starts it (its own broker and release worker), with `env` on
    top of ours: yields the API's URL and the Kafka address its READY line names; on exit,
    SIGTERM, and it must exit 0."""
    port = free_port()
    environ = {**os.environ, "FLYWHEEL_MODEL_DIR": str(model_dir), **env}
    for name in ("FLYWHEEL_KAFKA_BOOTSTRAP", "FLYWHEEL_CELERY_BROKER_URL"):
        environ.pop(name, None)
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "up", "--port", str(port),
                             "--data-dir", str(data_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=environ)
    try:
        line, deadline = "", time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline() if proc.stdout else ""
            if line.startswith("READY"):
                break
        words = line.split()
        assert words[:2] == ["READY", f"http://127.0.0.1:{port}"], line
        assert words[2].startswith("kafka=127.0.0.1:"), line
        yield words[1], words[2].removeprefix("kafka=")
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-3000:]
