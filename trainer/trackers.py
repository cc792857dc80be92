"""Experiment trackers: where the trainers' step metrics go, besides their own logs.

Both trainers (`flywheel train-online`, `flywheel bootstrap`) report each step through one
seam, `Trackers.report(step, metrics)`. TensorBoard event files are written by default under
the run dir (`<run dir>/tensorboard`; `tensorboard --logdir <run dir>` reads them); MLflow
(the `mlflow` extra) gets the same scalars when `trackers.mlflow_tracking_uri` is set. The
names are `metric_name(trainer, key)`: `flywheel_online_loss`, `flywheel_bootstrap_reward`,
the names the API's `/metrics` gives the online trainer's figures (app/api/metrics.py), so one
metric reads the same in TensorBoard, MLflow, Prometheus and Grafana.

    FLYWHEEL_TRACKERS__TENSORBOARD=false                       # no event files
    FLYWHEEL_TRACKERS__MLFLOW_TRACKING_URI=sqlite:///data/mlflow.db
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field

log = logging.getLogger(__name__)
TrainerName = Literal["online", "bootstrap"]


class TrackerSettings(BaseModel):
    """Which trackers the trainers report to (composed into `Settings` as `trackers`)."""

    tensorboard: bool = Field(default=True, description="event files under the run dir")
    mlflow_tracking_uri: str | None = Field(
        default=None, description="MLflow tracking URI (sqlite:///…, http://…); None: off")
    mlflow_experiment: str = Field(default="flywheel", min_length=1)


def metric_name(trainer: TrainerName, key: str) -> str:
    """The one name of a trainer's step metric in every tracker and in Prometheus: the
    `flywheel_` prefix, the trainer, the key, seconds spelled out (`wall_s` -> `wall_seconds`)."""
    key = key[:-2] + "_seconds" if key.endswith("_s") else key
    return f"flywheel_{trainer}_{key}"


def scalars(trainer: TrainerName, metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numeric entries of `metrics`, under their tracker names."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, int | float) and not isinstance(value, bool) \
                and math.isfinite(value):
            out[metric_name(trainer, key)] = float(value)
    return out


class Tracker(Protocol):
    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Scalars as TensorBoard event files (torch's `SummaryWriter`)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()  # a step is seconds apart: readers see it at once

    def close(self) -> None:
        self.writer.close()


class MlflowTracker:
    """One MLflow run per trainer process, through `MlflowClient` (no global active run)."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str,
                 params: Mapping[str, Any]) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = (found.experiment_id if found is not None
                         else self.client.create_experiment(experiment))
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        for key, value in params.items():
            self.client.log_param(self.run_id, key, str(value)[:500])

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            Metric(name, value, now, step) for name, value in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Trackers:
    """Every configured tracker of one trainer run; `report` fans a step out to all."""

    def __init__(self, trainer: TrainerName, trackers: list[Tracker]) -> None:
        self.trainer = trainer
        self.trackers = trackers

    def report(self, step: int, metrics: Mapping[str, Any]) -> None:
        values = scalars(self.trainer, metrics)
        for tracker in self.trackers:
            tracker.log(step, values)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def build_trackers(settings: TrackerSettings, trainer: TrainerName, run_dir: Path, *,
                   params: Mapping[str, Any] | None = None) -> Trackers:
    """The trackers `settings` turns on for a run of `trainer` whose files live in `run_dir`."""
    trackers: list[Tracker] = []
    if settings.tensorboard:
        trackers.append(TensorBoardTracker(run_dir / "tensorboard"))
    if settings.mlflow_tracking_uri is not None:
        trackers.append(MlflowTracker(settings.mlflow_tracking_uri, settings.mlflow_experiment,
                                      f"{trainer}-{time.strftime('%Y%m%d-%H%M%S')}",
                                      params or {}))
    return Trackers(trainer, trackers)
