"""Trackers: the online trainer on the real broker writes its step metrics as TensorBoard event
files under its run dir (read back with tensorboard's own `EventAccumulator`) and to MLflow
(a SQLite tracking store, read back with `MlflowClient`), under the names Prometheus uses."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.settings import Settings
from ingest.log import EventProducer
from tests.trainer.helpers import make_experiences
from trainer.trackers import TrackerSettings, metric_name, scalars

STEPS = 2


def test_metric_names_are_prometheus_names() -> None:
    assert metric_name("online", "loss") == "flywheel_online_loss"
    assert metric_name("bootstrap", "wall_s") == "flywheel_bootstrap_wall_seconds"
    assert scalars("online", {"loss": 0.5, "batch": 4, "nan": float("nan"), "ok": True,
                              "ids": [1]}) == {"flywheel_online_loss": 0.5,
                                               "flywheel_online_batch": 4.0}


@pytest.mark.integration
def test_online_trainer_reports_to_tensorboard_and_mlflow(settings: Settings, tmp_path: Path,
                                                         model_dir: Path) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainer.online.process import run_online

    producer = EventProducer(settings.kafka_config(settings.kafka_bootstrap or ""))
    for exp in make_experiences(model_dir, 4 * STEPS, seed=3):
        producer.send(settings.topics.experiences, exp.experience_id, exp)
    producer.flush(timeout_s=30)
    producer.close()
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    settings = settings.model_copy(update={
        "online": settings.online.model_copy(update={
            "min_batch": 4, "max_batch": 4, "stop_after": 4 * STEPS, "poll_timeout_ms": 100,
            "group_id": "trackers-test"}),
        "trackers": TrackerSettings(mlflow_tracking_uri=mlflow_uri,
                                    mlflow_experiment="trackers-test")})
    report = run_online(settings)
    assert report.steps == STEPS

    run_dir = settings.online.resolved_checkpoint_dir(settings.data_dir)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for key in ("loss", "reward", "kl", "clipped", "grad_norm", "batch"):
        assert metric_name("online", key) in tags, sorted(tags)
    loss = events.Scalars("flywheel_online_loss")
    assert [e.step for e in loss] == list(range(1, STEPS + 1))

    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name("trackers-test")
    assert experiment is not None
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert set(run.data.metrics) == tags  # the same names in both
    history = client.get_metric_history(run.info.run_id, "flywheel_online_loss")
    assert [m.step for m in history] == [e.step for e in loss]
    assert [m.value for m in history] == pytest.approx([e.value for e in loss], rel=1e-6)
