"""Configuration of `flywheel bootstrap`: mid-training, then pipelined GRPO on verifiable tasks.

Composed into `app.settings.Settings` as `bootstrap` (FLYWHEEL_BOOTSTRAP__GROUP_SIZE=16); it
imports no torch, so `flywheel --help` stays fast."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field, PositiveFloat, model_validator

from ingest.rollout_events import RewardConfig
from serving.config import DEFAULT_PREFIX_CACHE_TOKENS
from simulate.agents import AgentProgram
from simulate.task_templates import LETTER_FAMILIES
from simulate.tasks import BuiltinTasksConfig, TaskSourceConfig

if TYPE_CHECKING:
    from simulate.harness import HarnessConfig
    from simulate.rollout_worker import WorkerOptions

ClipAnchor = Literal["trainer", "behavior"]
LETTER_WEIGHT = 4.0  # mid-training's draw weight of the built-in letter templates


class BootstrapSettings(BaseModel):
    """Defaults are tuned for the default tiny model on a 2-core CPU (about 13 minutes)."""

    run_dir: Path | None = None  # default: <data_dir>/runs/bootstrap-<time>
    tasks: TaskSourceConfig = Field(default_factory=BuiltinTasksConfig)
    seed: int = 0
    # mid-training
    # 1300 steps: with the function-calling transcripts the copying of a task's parameter forms
    # between 625 and 700 steps (greedy held-out 24% at 625, 48% at 650, 54% at 700; 72% at
    # 900, 84% at 1300); single lower-case letters are the last values it learns to copy
    # (docs/bootstrap.md)
    midtrain_steps: int = Field(default=1300, ge=0)
    midtrain_batch: int = Field(default=16, ge=1)
    # peak, after a 10-step warm-up. 1e-3: the copying of a parameter forms at 450-575 steps
    # (4 seeds, GPU; 450 on a CPU where 3e-3 had not formed it by 1000), 3e-3 at 500-775+
    midtrain_lr: float = Field(default=1e-3, gt=0)
    midtrain_lr_floor: float = Field(default=1.0, gt=0, le=1)  # cosine end, x peak; 1: constant
    midtrain_practice: bool = True  # add the source's practice tasks to the corpus
    # How often mid-training draws a family's demonstrations (a task's `family`), against 1 for
    # a family not named. The built-in letter templates weigh `LETTER_WEIGHT`: a lower-case
    # letter is the last parameter a tiny model learns to copy; drawn as often as the others,
    # it was copied by 1300 steps on an AMD CPU (94% held-out) and not on an Intel one (78%),
    # weighed 4 it forms with the integers (90% on that Intel CPU; docs/bootstrap.md)
    midtrain_family_weights: dict[str, PositiveFloat] = Field(
        default_factory=lambda: dict.fromkeys(LETTER_FAMILIES, LETTER_WEIGHT))
    # Stop mid-training early, at the first check (every `midtrain_check_every` steps) where the
    # model writes the first call of the first `eval_tasks` practice tasks held back for GRPO
    # (in the source's order: `add`, `sub` and `mul` alone; docs/bootstrap.md) with this mean
    # probability when sampling at `midtrain_check_temperature`; midtrain_steps is then the
    # most it runs. The copying of a parameter forms as a sharp transition whose step moves
    # with the CPU's float order, so a start of a given strength is a quality, not a count
    # (the demo's version 0). None: midtrain_steps exactly
    midtrain_until: float | None = Field(default=None, gt=0, le=1)
    midtrain_check_every: int = Field(default=25, ge=1)
    midtrain_check_temperature: float = Field(default=0.7, gt=0)
    # GRPO
    mode: Literal["async", "sync"] = "async"
    # A share of the source's practice tasks is held back from mid-training for GRPO: values
    # the model never saw, so only copying the parameter earns their reward (the train split,
    # memorized by the end of mid-training, gives GRPO little signal). 0: GRPO on the train
    # split only (docs/bootstrap.md)
    grpo_practice_fraction: float = Field(default=0.25, ge=0.0, le=1.0)
    # a task whose recent episodes all passed is drawn with this weight (1 when none did;
    # trainer/bootstrap/task_sampler.py): groups that cannot teach anything cost as much as
    # any. 1: all tasks alike
    solved_task_weight: float = Field(default=0.1, gt=0.0, le=1.0)
    group_size: int = Field(default=8, ge=2, le=128)
    groups_per_step: int = Field(default=4, ge=1)
    max_staleness: int = Field(default=1, ge=0)
    lr: float = Field(default=3e-4, gt=0)  # 1e-3 collapsed the mid-trained policy
    # the rate decays by cosine to lr_floor x lr over the run (its time budget or max_steps,
    # whichever is nearer). 1: constant. 0.1 steadied the last steps but ended lower (docs)
    lr_floor: float = Field(default=1.0, gt=0, le=1)
    temperature: float = Field(default=1.0, gt=0, le=2.0)
    max_tokens: int = Field(default=64, ge=4)  # per turn; the longest edit is ~50
    max_turns: int = Field(default=3, ge=1)
    # self-summarization: past context_budget tokens the agent summarizes its work and goes on
    # in a fresh window from the summary, at most max_summaries times an episode
    context_budget: int = Field(default=1024, ge=64)
    max_summaries: int = Field(default=2, ge=0)
    # what a context past the budget becomes: "summarize", or "truncate" (the oldest turns
    # dropped: the baseline bench/horizon.py measures summarizing against)
    context_overflow: Literal["summarize", "truncate"] = "summarize"
    # how an episode is scored, sent with every rollout job: its tests, and a rubric judge's
    # score blended in by weight (FLYWHEEL_BOOTSTRAP__REWARDS__JUDGE_WEIGHT=1,
    # __REWARDS__JUDGE__BASE_URL, __REWARDS__JUDGE__MODEL; each worker host holds the key in
    # FLYWHEEL_JUDGE_API_KEY). The default: the tests alone
    rewards: RewardConfig = Field(default_factory=RewardConfig)
    clip: float = Field(default=0.2, gt=0, lt=1)  # PPO ratio clip (trainer.grpo)
    # the learner's MoE routers use the experts the workers' engines chose for each token
    # (kernels/moe_replay.py): a stale or numerically different forward then still computes
    # the logprobs of the experts that sampled the tokens. False: its routers choose again
    router_replay: bool = True
    is_cap: float = Field(default=2.0, gt=0)  # truncated IS against behavior logprobs
    # where the clip's ratio is anchored (trainer.grpo). "behavior": the logprobs the rollout
    # was sampled with, so the clip bounds how far a stale batch moves the policy, and is_cap
    # becomes the dual clip on negative advantages (> 1); "trainer": the policy being trained,
    # with the behavior correction as a weight capped at is_cap (the clip never engages)
    clip_anchor: ClipAnchor = "behavior"
    max_steps: int = Field(default=1000, ge=1)
    # GRPO's wall budget: `flywheel bootstrap` stops at whichever of max_steps and this comes
    # first, so on a slower machine it makes fewer steps. None: max_steps alone, the same
    # training on any machine (the demo's bootstrap)
    time_budget_s: float | None = Field(default=360.0, gt=0)
    # GRPO's own yardstick: this many of the practice tasks held back from mid-training (drawn
    # across templates) are held back from GRPO too. They are scored (one greedy episode each)
    # at the start, every `eval_every` steps and at the last; the held-out split is scored only
    # before GRPO and on the kept version, so nothing chooses by it. 0: none
    validation_tasks: int = Field(default=64, ge=0)
    # end on the version that scored best on the validation tasks (the earliest on a tie), the
    # mid-trained start included: GRPO's score swings by ±10 points within a run on the
    # default model (docs/bootstrap.md). False: the last version
    keep_best: bool = True
    eval_every: int = Field(default=10, ge=1)
    eval_temperature: float = Field(default=0.0, ge=0)  # 0: greedy pass@1
    eval_tasks: int = Field(default=64, ge=1)  # held-out (and validation) tasks scored, at most
    # worker processes the bootstrap starts on this host (simulate/rollout_worker.py); 0: only the
    # `flywheel rollout-worker`s that join from elsewhere. Two even on 2 cores: one worker's
    # sandbox and Python turns leave its engine idle, which the other's fills
    rollout_workers: int = Field(default=2, ge=0)
    # where policy versions go for the workers (an artifact store URL); None: <run_dir>/policy
    policy_store_url: str | None = None
    groups_in_flight: int = Field(default=4, ge=1)  # per worker, of one step: one decode batch
    torch_threads: int = Field(default=1, ge=1)
    # mid-training runs alone (no rollouts yet): it may use every core. None: os.cpu_count()
    midtrain_threads: int | None = Field(default=None, ge=1)
    # keys/values of recent sequences kept per engine (2 KB a token for the default model):
    # later turns and a group's G copies of a prompt prefill only new tokens. 0: off
    prefix_cache_tokens: int = Field(default=DEFAULT_PREFIX_CACHE_TOKENS, ge=0)
    # tool calls and scoring as the Celery sandbox task on the sandbox fleet behind this broker
    # (redis://…; `celery worker -Q flywheel-sandbox` hosts); None: the local sandbox
    sandbox_url: str | None = None
    # the product's agent program whose episodes GRPO trains on (simulate/agents.py: the
    # contract): each episode a process of it, on an OpenAI endpoint the worker serves on its
    # policy version (`flywheel bootstrap --agent CMD`). None: the built-in harness, run in
    # the workers' processes on token ids
    agent: AgentProgram | None = None

    @model_validator(mode="after")
    def _dual_clip_above_one(self) -> BootstrapSettings:
        if self.clip_anchor == "behavior" and self.is_cap <= 1.0:
            raise ValueError(f"is_cap must be > 1 with clip_anchor 'behavior' (it bounds a "
                             f"negative-advantage token's loss at is_cap x |A|); got {self.is_cap}")
        return self

    def harness(self, *, temperature: float) -> HarnessConfig:
        """The multi-turn agent's shape, shared by rollouts, the eval gate and the simulated
        developers: what the bootstrap trains is what they run."""
        from simulate.harness import HarnessConfig

        return HarnessConfig(max_turns=self.max_turns, max_tokens=self.max_tokens,
                             temperature=temperature, context_budget=self.context_budget,
                             max_summaries=self.max_summaries, overflow=self.context_overflow)

    def worker_options(self, worker_id: str, *, batch_invariant: bool) -> WorkerOptions:
        """A rollout worker's options at these settings (the bootstrap's own workers and
        `flywheel rollout-worker` alike)."""
        from simulate.rollout_worker import WorkerOptions

        return WorkerOptions(worker_id=worker_id, groups_in_flight=self.groups_in_flight,
                             torch_threads=self.torch_threads,
                             prefix_cache_tokens=self.prefix_cache_tokens,
                             batch_invariant=batch_invariant, seed=self.seed,
                             sandbox_url=self.sandbox_url, agent=self.agent)

    @property
    def staleness(self) -> int:
        """The bound the gate enforces: 0 in sync mode (trainer and rollouts take turns)."""
        return 0 if self.mode == "sync" else self.max_staleness
