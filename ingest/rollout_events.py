"""The rollout fleet's wire types: a job for a group of episodes out, the group back.

Invariants (checked on decode, as for every type in `ingest/events.py`):
- `RolloutJob.min_version <= step`; a `RolloutGroup` made for a job has `group_id == job_id`.
- A `RolloutTrajectory`'s per-token arrays have one entry per token, and its segment lengths
  sum to that count.

Topics and keys: rollout-jobs and rollouts by job_id.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Final, Literal

from pydantic import BaseModel, Field, model_validator

from ingest.events import SCHEMA_VERSION, PackedArray, utcnow

# 2: each trajectory's anti-cheat flags; 3: job_id, worker; 4: each trajectory's ended_by;
# 5: the agent episodes dropped and made again, by reason
ROLLOUT_SCHEMA_VERSION: Final = 5


class RolloutTrajectory(BaseModel):
    """One agent episode, its context windows packed end to end.

    `token_ids`, `loss_mask` (1 = model token) and `logprobs` (behavior policy, 0 where the
    mask is 0) have one entry per token; `segment_lengths` splits them into the context windows
    (self-summarization starts a new one) and sums to their length. `routed_experts`, when
    present, has one row per token (rows past what the engine routed are -1, no route; zero
    padding in records before version 4). `flags` are the anti-cheat checks that zeroed
    `reward` (`simulate.rewards`); [] when clean. `ended_by`: what ended the episode, the
    agent's `finish` call, its turn budget, or a context with no room for another turn
    (None before version 4).
    """

    token_ids: PackedArray
    loss_mask: PackedArray
    logprobs: PackedArray
    segment_lengths: PackedArray
    routed_experts: PackedArray | None = None
    reward: float
    turns: int = Field(ge=0)
    finished: bool
    flags: list[str] = Field(default_factory=list)
    ended_by: Literal["finished", "turns", "context"] | None = None

    @model_validator(mode="after")
    def _aligned(self) -> RolloutTrajectory:
        t = len(self.token_ids)
        for name in ("loss_mask", "logprobs"):
            if len(getattr(self, name)) != t:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {t} tokens")
        if int(self.segment_lengths.unpack().sum()) != t:
            raise ValueError(f"segment_lengths do not sum to the {t} tokens")
        if self.routed_experts is not None and self.routed_experts.shape[0] != t:
            raise ValueError(f"routed_experts has {self.routed_experts.shape[0]} rows for {t}")
        return self


class RolloutGroup(BaseModel):
    """G rollouts of one task by one policy version: the unit GRPO normalizes rewards over.
    Made for a `RolloutJob` (`job_id`, its key on `rollouts`) by rollout worker `worker`;
    version 1-2 records have neither."""

    event: Literal["RolloutGroup"] = "RolloutGroup"
    schema_version: Literal[1, 2, 3, 4, 5] = ROLLOUT_SCHEMA_VERSION
    group_id: str = Field(min_length=1, max_length=128)
    task_id: str = Field(min_length=1, max_length=256)
    policy_version: int = Field(ge=0)
    trajectories: list[RolloutTrajectory] = Field(min_length=1)
    created_at: datetime = Field(default_factory=utcnow)
    job_id: str | None = Field(default=None, min_length=1, max_length=128)
    worker: str | None = Field(default=None, max_length=128)
    # episodes of an agent program dropped and made again, by reason (`simulate.agents`)
    dropped: dict[str, int] = Field(default_factory=dict)


class RolloutSampling(BaseModel):
    """How a job's episodes are sampled: the harness's shape (`simulate.harness`)."""

    temperature: float = Field(gt=0, le=2.0)
    max_tokens: int = Field(ge=1)
    max_turns: int = Field(ge=1)
    context_budget: int = Field(ge=16)
    max_summaries: int = Field(default=2, ge=0)
    overflow: Literal["summarize", "truncate"] = "summarize"


RewardMode = Literal["partial", "fraction", "all"]


class JudgeConfig(BaseModel):
    """A rubric judge: any OpenAI-compatible chat endpoint, asked for a 0-10 score. Its key
    never travels with a job: each worker reads it from its own environment variable
    `api_key_env` (unset or empty: no key is sent)."""

    base_url: str = Field(min_length=1)  # e.g. http://localhost:8000/v1
    model: str = Field(min_length=1)
    rubric: str = "Score the solution from 0 (useless) to 10 (correct, clear, idiomatic)."
    api_key_env: str = "FLYWHEEL_JUDGE_API_KEY"
    timeout_s: float = Field(default=30.0, gt=0)


class RewardConfig(BaseModel):
    """How a job's episodes are scored (`simulate.rewards.compute_reward`): the tests' verdict,
    blended with a judge's score by weight when one is configured, zeroed by the anti-cheat
    checks either way. The default: the tests alone."""

    # "partial": 1 when every test passes, else `partial_credit` x the share passed (a
    # solved task stands clear of any partial one); "fraction": the share of tests passed;
    # "all": all-or-nothing
    mode: RewardMode = "partial"
    partial_credit: float = Field(default=0.5, ge=0.0, le=1.0)
    verifiable_weight: float = Field(default=1.0, ge=0)
    judge_weight: float = Field(default=0.0, ge=0)
    judge: JudgeConfig | None = None


class RolloutJob(BaseModel):
    """One group to make, keyed by `job_id` on the rollout-jobs topic: `group_size` episodes
    of `task` (a `simulate.tasks.Task` as JSON) with episode seeds from `seed`, on policy
    weights of version `min_version` or newer. The group is consumed at trainer step `step`,
    which publishes version `step + 1`: once a newer version than `step` is announced, the
    job is obsolete and a worker drops it unmade."""

    event: Literal["RolloutJob"] = "RolloutJob"
    schema_version: Literal[1] = SCHEMA_VERSION
    job_id: str = Field(min_length=1, max_length=128)
    run_id: str = Field(min_length=1, max_length=128)
    step: int = Field(ge=0)
    min_version: int = Field(ge=0)
    group_size: int = Field(ge=1, le=1024)
    seed: int = Field(ge=0)
    task: dict[str, Any]
    sampling: RolloutSampling
    rewards: RewardConfig = Field(default_factory=RewardConfig)  # how the episodes are scored
    created_at: datetime = Field(default_factory=utcnow)

    @model_validator(mode="after")
    def _version_fits_step(self) -> RolloutJob:
        if self.min_version > self.step:
            raise ValueError(f"min_version {self.min_version} is newer than the version "
                             f"step {self.step} trains ({self.step})")
        return self
