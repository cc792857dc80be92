"""Release configuration owned by `trainer`: `ReleaseSettings` (composed into
`app.settings.Settings`) and `ReleaseConfig`, everything the pipeline of trainer/release/pipeline.py
needs, which `Settings.release_config()` resolves.

The eval gate is a choice between suites (a discriminated union on `kind`); `build_eval_suite`
in `trainer/release/eval_gate.py` turns it into the suite object. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, Field

from ingest.config import KafkaConfig
from simulate.tasks import TaskSourceConfig

if TYPE_CHECKING:
    from simulate.harness import HarnessConfig


class HeldOutTasksEval(BaseModel):
    """pass@1 of the multi-turn tool agent (the bootstrap's harness) on the held-out split of
    the bootstrap's task source: tasks never served to the product and never trained on,
    checked by their tests in the sandbox. Each task runs `samples_per_task` episodes at
    `temperature` (pass@1: the mean over tasks of the share of its episodes that pass; 0 and
    1 sample: greedy). The gate compares the candidate with the served version task by task
    and refuses it only when the upper `confidence` bound of the change is below
    -`max_drop_points`: a candidate no worse than that is refused with probability at most
    1 - `confidence` (trainer/release/eval_gate.py, docs/releases.md). The default: it guards the
    ability the product uses."""

    kind: Literal["held_out_tasks"] = "held_out_tasks"
    max_tasks: int = Field(default=64, ge=1, description="the first N held-out tasks")
    samples_per_task: int = Field(default=8, ge=1, le=256)
    # the temperature the product's agent samples at (the demo's developers: 0.7)
    temperature: float = Field(default=0.7, ge=0.0, le=2.0)
    seed: int = 0  # both versions sample with the same seeds: their difference is less noisy
    max_drop_points: float = Field(
        default=2.0, ge=0.0, le=100.0,
        description="refuse a candidate shown to be more points below the served one")
    confidence: float = Field(default=0.95, gt=0.5, lt=1.0,
                              description="1 - the chance of refusing a candidate that is "
                                          "no worse than max_drop_points")


class HeldOutLossEval(BaseModel):
    """Mean next-token loss on a fixed held-out token set (stdlib source the tokenizer and
    the default model never saw). Lower is better."""

    kind: Literal["heldout_loss"] = "heldout_loss"
    sequences: int = Field(default=8, ge=1, le=4096)
    seq_len: int = Field(default=128, ge=8, le=8192)
    max_regression: float = Field(default=0.05, ge=0.0,
                                  description="reject when loss rises by more (nats/token)")


class CallableEval(BaseModel):
    """`module:function(model, tokenizer) -> dict[str, float]` holding `metric`; the gate
    refuses a candidate whose metric is worse than the served one's by more than
    `max_regression` (lower is better unless `higher_is_better`)."""

    kind: Literal["callable"] = "callable"
    path: str = Field(pattern=r"^[\w.]+:\w+$")
    metric: str = "loss"
    higher_is_better: bool = False
    max_regression: float = Field(default=0.05, ge=0.0)


EvalSettings = Annotated[HeldOutTasksEval | HeldOutLossEval | CallableEval,
                         Field(discriminator="kind")]


class MetricTestSettings(BaseModel):
    """One metric's test: how much worse the candidate may be before it is rolled back."""

    margin: float = Field(gt=0.0, description="worse by this much: roll back (metric units)")
    # floors each arm's variance: early on, a run of identical outcomes says little
    min_variance: float = Field(default=0.01, gt=0.0)


class CanarySettings(BaseModel):
    """The canary of trainer/release/canary.py: a share of sessions, two error rates, the
    metrics and their margins, when to decide at the earliest and at the latest."""

    enabled: bool = Field(default=False, description="a release that passes the gate serves "
                                                     "`share` of sessions until the test "
                                                     "decides")
    serve: bool = Field(default=True, description="this replica serves a canary on a second "
                                                  "engine (a second copy of the weights)")
    decide: bool = Field(default=True, description="this API process runs the canary's test "
                                                   "and publishes its decision")
    share: float = Field(default=0.2, gt=0.0, lt=1.0,
                         description="the share of sessions the candidate serves")
    alpha: float = Field(default=0.05, gt=0.0, lt=0.5,
                         description="P(promote a candidate worse by the margin)")
    beta: float = Field(default=0.05, gt=0.0, lt=0.5,
                        description="P(roll back a candidate as good as the incumbent), "
                                    "per metric")
    acceptance: MetricTestSettings = MetricTestSettings(margin=0.10, min_variance=0.01)
    # rewards span [-1, 1], twice acceptance's range: twice its margin
    reward: MetricTestSettings = MetricTestSettings(margin=0.20, min_variance=0.04)
    min_sessions: int = Field(default=30, ge=2,
                              description="per arm, before any decision (the normal "
                                          "approximation's floor)")
    max_sessions: int = Field(default=4000, ge=2,
                              description="candidate sessions without a decision: hold")


class MonitorSettings(BaseModel):
    """The reward-hacking monitors of trainer/release/monitors.py: how far a version may move
    from the one before it before a monitor trips. Rates are shares of the generations
    offered tools; a rise trips when it passes its threshold and the one-sided test at
    `confidence` says it is real."""

    enabled: bool = True
    # "pause": a breach pauses the trainer and holds its releases until resumed; "report":
    # it is recorded and shown, and training and releases go on
    on_breach: Literal["pause", "report"] = "pause"
    min_generations: int = Field(default=200, ge=1,
                                 description="per version, before a rate monitor can trip")
    confidence: float = Field(default=0.99, gt=0.5, lt=1.0)
    invalid_call_rise: float = Field(default=0.05, ge=0.0,
                                     description="turns with a botched tool call")
    no_call_rise: float = Field(default=0.10, ge=0.0,
                                description="turns offered tools that made no call")
    question_rise: float = Field(default=0.05, ge=0.0,
                                 description="turns that asked a question instead of acting")
    length_ratio: float = Field(default=1.5, gt=1.0,
                                description="mean completion tokens over the version before")
    acceptance_gap: float = Field(default=0.15, ge=0.0,
                                  description="live acceptance's rise minus held-out "
                                              "pass@1's: the two moving apart")
    max_kl: float = Field(default=0.5, gt=0.0,
                          description="the online trainer's KL to the served release")
    max_clip_fraction: float = Field(default=0.3, gt=0.0, le=1.0)


class ReleaseSettings(BaseModel):
    """The release pipeline (trainer/release/pipeline.py) and the replicas that follow it."""

    interval_s: float = Field(default=3 * 3600, ge=1, description="Celery beat period")
    snapshot_every: int = Field(default=8, ge=1,
                                description="a full snapshot every K releases resets the chain")
    candidate_path: Path | None = Field(
        default=None, description="trainer checkpoint (HF dir or .safetensors); None: "
                                  "<data_dir>/checkpoints/latest")
    eval: EvalSettings = HeldOutTasksEval()
    poll_timeout_ms: int = Field(default=200, ge=10, description="replica subscriber poll")
    follow: bool = Field(default=True, description="serving replicas hot-swap releases")
    canary: CanarySettings = CanarySettings()


@dataclass(frozen=True)
class ReleaseConfig:
    """The release pipeline's inputs, resolved: no profile logic below this point."""

    release: ReleaseSettings
    model_dir: Path  # the base model (architecture, tokenizer, version 0)
    candidate_path: Path  # built when a request names no candidate
    cache_dir: Path  # the served head's weights (and its eval figures) are cached here
    store_url: str  # artifact store: a directory or any fsspec URL
    database_url: str  # the `release` table: the history
    kafka: KafkaConfig  # where `ReleasePublished` goes (topic `releases`)
    # the held-out tasks gate: the bootstrap's task source and harness
    tasks: TaskSourceConfig
    harness: HarnessConfig

    @property
    def head_cache(self) -> Path:
        return self.cache_dir / "head.safetensors"
