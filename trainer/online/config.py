"""Configuration of the online trainer (`flywheel train-online`), composed into `Settings`.

The baseline is a choice between variants, so it is a discriminated union on `kind`:
`batch_mean` (leave-one-out mean of the batch's rewards) or `bucket_mean` (a running mean per
context bucket, the prompt by default, carried across batches and checkpointed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, model_validator

from simulate.tasks import BuiltinTasksConfig, TaskSourceConfig
from trainer.release.config import MonitorSettings

MAX_STALENESS = 63  # the trainer keeps the publication times of its last 64 releases


class BatchMeanBaseline(BaseModel):
    """b_i = mean of the other rewards in the batch (leave-one-out: unbiased)."""

    kind: Literal["batch_mean"] = "batch_mean"


class BucketMeanBaseline(BaseModel):
    """b_i = running mean reward of the context bucket of row i (before this batch).

    The bucket is a hash of the conversation's opening (the prompt up to its first assistant
    turn: the system and user messages, the task) modulo `buckets`, so every turn of an
    agent's sessions on one task meets that task's mean; a bucket never seen yet uses the
    running mean over all buckets. `decay` floors the step size of the running mean
    (exact mean for the first 1/decay rewards, then an exponential moving average).
    """

    kind: Literal["bucket_mean"] = "bucket_mean"
    buckets: int = Field(default=4096, ge=1)
    decay: float = Field(default=0.05, gt=0.0, le=1.0)


BaselineSettings = Annotated[BatchMeanBaseline | BucketMeanBaseline, Field(discriminator="kind")]


class FormatAnchorSettings(BaseModel):
    """The format anchor (trainer/online/anchor.py): each step, `coef` x the KL from the
    served release to the policy on `rows` demonstration episodes of `tasks`' train split, at
    the positions where the served release's top token has probability >= `confidence`."""

    coef: float = Field(default=0.0, ge=0.0, description="0: no anchor")
    rows: int = Field(default=8, ge=1, description="demonstration episodes a step")
    confidence: float = Field(default=0.9, gt=0.0, le=1.0)
    tasks: TaskSourceConfig = Field(default_factory=BuiltinTasksConfig)
    seed: int = 0


class OnlineTrainerSettings(BaseModel):
    """`flywheel train-online`: batches, objective, checkpoints, release cadence."""

    group_id: str = Field(default="flywheel-trainer", min_length=1)
    checkpoint_dir: Path | None = None  # None: <data_dir>/trainer
    min_batch: int = Field(default=16, ge=1, description="train only on this many or more")
    max_batch: int = Field(default=32, ge=1)
    lr: float = Field(default=3e-4, gt=0.0)
    # the rate rises linearly to `lr` over the first steps: Adam's first steps move every weight
    # by about the full rate. In one demo at 2e-4 without it, one step took the policy to a KL
    # of 0.15 from the served release (ten steps after a release, Adam's moments built up,
    # reached 0.02), and the first 24 took held-out pass@1 from 25% to 6%. 0: none
    warmup_steps: int = Field(default=10, ge=0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    # AdamW's epsilon: a gradient element far below it moves its weight by about
    # lr * g / eps instead of a full lr, so rounding noise in a near-zero gradient stays noise
    adam_eps: float = Field(default=1e-8, gt=0.0)
    grad_clip: float = Field(default=1.0, gt=0.0)
    # how the update corrects for the policy having moved since a generation was served
    # (trainer/online/loss.py): "clipped", PPO's clip anchored at the behavior logprobs (the
    # bootstrap's GRPO loss), or "truncated_is", importance weights capped at is_cap
    objective: Literal["clipped", "truncated_is"] = "clipped"
    clip: float = Field(default=0.2, gt=0.0, lt=1.0, description="PPO ratio clip (clipped)")
    is_cap: float = Field(default=2.0, gt=1.0, description="the dual clip's c (clipped) or "
                          "the importance weight cap (truncated_is)")
    # Bounded staleness: train only on generations made since the trainer's last
    # max_staleness + 1 releases were published; older ones are passed over, never trained
    # (counted as stale). When the traffic outruns the trainer, its backlog would otherwise
    # grow without end and each release learn from what an older one served: in the demo at
    # 10 developers the trainer took half of the traffic, and every release was trained on the
    # sessions of the version before the one it replaced. None: everything, in order.
    max_staleness: int | None = Field(default=None, ge=0, le=MAX_STALENESS)
    kl_coef: float = Field(default=0.02, ge=0.0, description="KL anchor to the served release")
    anchor: FormatAnchorSettings = FormatAnchorSettings()
    # reward-hacking monitors on the served versions' traffic (trainer/online/monitor_watch.py)
    monitors: MonitorSettings = MonitorSettings()
    normalize_advantages: bool = False
    router_replay: bool = True
    baseline: BaselineSettings = BucketMeanBaseline()
    checkpoint_every_steps: int = Field(default=1, ge=1)
    keep_checkpoints: int = Field(default=2, ge=1)
    # the trainer hands its weights to the release pipeline every release_every_steps steps
    # where set (the same training per release on any machine: the demo), else every
    # release_interval_s of wall time (a product's cadence: every few hours)
    release_every_steps: int | None = Field(default=None, ge=1)
    release_interval_s: float = Field(default=3 * 3600.0, gt=0.0)
    # True: the pipeline builds and gates a candidate on a thread while the trainer trains on
    # from it, on what the served release generates meanwhile (docs/online.md#releases: two
    # demo runs, shorter, their gains within the runs' spread); False: the trainer waits
    release_in_background: bool = False
    poll_timeout_ms: int = Field(default=200, ge=1)
    control_every_s: float = Field(default=1.0, gt=0.0)
    # Deterministic mode: 1 thread, torch.use_deterministic_algorithms, fixed seed. Two runs
    # fed the same batches end bit-identical (the chaos test relies on it).
    deterministic: bool = False
    threads: int | None = Field(default=None, ge=1)
    seed: int = 0
    # Over N ranks: a collective that waits longer than this fails (a rank hung or its host
    # is gone; a rank that dies is noticed by the launcher's agent within a second). The
    # other ranks wait in one while the leader runs the eval gate of a release.
    collective_timeout_s: float = Field(default=1800.0, gt=0.0)
    max_restarts: int = Field(default=3, ge=0, description="--nproc: restarts of all ranks "
                              "after one died, each from the last checkpoint")
    # Stop after this many trained experiences, or after this many releases were published
    # (tests, demos); None runs until told to stop.
    stop_after: int | None = Field(default=None, ge=1)
    stop_after_releases: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _batch_bounds(self) -> OnlineTrainerSettings:
        if self.max_batch < self.min_batch:
            raise ValueError("online.max_batch must be >= online.min_batch")
        return self

    def resolved_checkpoint_dir(self, data_dir: Path) -> Path:
        return self.checkpoint_dir if self.checkpoint_dir is not None else data_dir / "trainer"
