"""Offline bootstrap: mid-training, then GRPO on group rollouts, pipelined with bounded staleness.

`OfflineTrainer` is the learner (named phases: `forward_backward`, `step`, `state_dict`,
`close`); the rollouts come from the fleet (trainer/bootstrap/fleet.py: jobs out and groups in over
Kafka, each policy version out as a delta; simulate/rollout_worker.py: the workers). `run_bootstrap`
wires them, evaluates held-out pass@1 before and after, and writes metrics and a plot.

    flywheel bootstrap --data-dir data        # see docs/bootstrap.md
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ingest.config import KafkaConfig
from ingest.rollout_events import RolloutGroup
from kernels.delta.store import artifact_store_config, build_artifact_store
from serving.torch_engine import TorchEngine
from simulate.rollouts import (
    SandboxCache,
    TaskOutcome,
    episode_shape,
    mean_episode_shape,
    pass_rate,
    solved,
    unpack_segments,
)
from simulate.tasks import Task
from trainer.bootstrap.artifacts import (
    KeptVersion,
    append_metrics,
    plot_run,
    save_version,
    write_final_outcomes,
    write_outcomes,
)
from trainer.bootstrap.config import BootstrapSettings, ClipAnchor
from trainer.bootstrap.fleet import LocalFleet, RolloutFleet, open_local_fleet
from trainer.bootstrap.local_engine import evaluate, load_weights, make_engine
from trainer.bootstrap.midtrain import cosine_factor
from trainer.bootstrap.policy_publisher import PolicyPublisher, model_files
from trainer.bootstrap.task_sampler import TaskSampler
from trainer.distributed import World
from trainer.grpo import GRPOLossConfig, group_advantages, grpo_loss
from trainer.policy import Policy, Rows, TokenBatch
from trainer.trackers import Trackers, TrackerSettings, build_trackers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GrpoObjective:
    """The bootstrap's GRPO loss as a `trainer.policy.Objective`: the clipped surrogate with
    its ratio anchored at the rollout's behavior logprobs or at the policy being trained."""

    config: GRPOLossConfig
    temperature: float
    clip_anchor: ClipAnchor
    aggregation: str = "token"

    def loss(self, logp: torch.Tensor, batch: TokenBatch, behavior: torch.Tensor | None,
             advantages: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
        assert behavior is not None and advantages is not None  # GrpoObjective's rows have them
        anchor = behavior if self.clip_anchor == "behavior" else logp.detach()
        loss, metrics = grpo_loss(logp, anchor, advantages, batch.loss_mask, config=self.config,
                                  behavior_logp=behavior)
        mismatch = ((logp.detach() - behavior).abs() * batch.loss_mask).max()
        return loss, metrics | {"max_abs_logprob_diff": float(mismatch)}


class OfflineTrainer:
    """GRPO on `RolloutGroup`s: one optimizer step per trainer step."""

    def __init__(self, policy: Policy, loss: GRPOLossConfig, *, temperature: float,
                 clip_anchor: ClipAnchor = "trainer", router_replay: bool = True) -> None:
        self.policy = policy
        self.objective = GrpoObjective(loss, temperature, clip_anchor, loss.aggregation)
        self.router_replay = router_replay

    @classmethod
    def from_settings(cls, policy: Policy, cfg: BootstrapSettings) -> OfflineTrainer:
        if cfg.clip_anchor == "behavior":
            loss = GRPOLossConfig(clip_low=cfg.clip, clip_high=cfg.clip, is_cap=None,
                                  dual_clip=cfg.is_cap)
        else:
            loss = GRPOLossConfig(clip_low=cfg.clip, clip_high=cfg.clip, is_cap=cfg.is_cap)
        return cls(policy, loss, temperature=cfg.temperature, clip_anchor=cfg.clip_anchor,
                   router_replay=cfg.router_replay)

    @staticmethod
    def rows(groups: list[RolloutGroup], *, routes: bool = True
             ) -> tuple[Rows, dict[str, float]]:
        """The groups' trainable segments with their advantages (and, with `routes`, the
        experts the workers' engines routed their tokens to, for the learner to replay), and
        the groups' metrics. A group whose rewards are all equal has no signal (every
        advantage is 0): left out."""
        rows = Rows([], [], [], [], [] if routes else None)
        rewards = []
        for group in groups:
            r = torch.tensor([t.reward for t in group.trajectories])  # (N,)
            rewards.append(r)
            adv = group_advantages(r[None])[0]  # (N,)
            if float(r.std()) < 1e-6:
                continue
            for traj, a in zip(group.trajectories, adv.tolist(), strict=True):
                for seg in unpack_segments(traj):
                    rows.sequences.append(seg.token_ids)
                    rows.masks.append(seg.loss_mask)
                    rows.behavior.append(seg.logprobs)  # type: ignore[union-attr]
                    rows.advantages.append(a)  # type: ignore[union-attr]
                    if rows.routes is not None:
                        rows.routes.append(seg.routes)
        episodes = [t for g in groups for t in g.trajectories]
        metrics = {"reward": float(torch.cat(rewards).mean()),
                   "solved": sum(solved(t) for t in episodes) / len(episodes),
                   "trained_sequences": float(len(rows)),
                   "cheating_flagged": float(sum(bool(t.flags) for t in episodes)),
                   **episode_shape(episodes)}
        return rows, metrics

    def step(self, groups: list[RolloutGroup]) -> dict[str, float]:
        """One optimizer step on the groups, at the policy's current rate (a step with no
        signal still advances the version, the schedule's clock)."""
        rows, metrics = self.rows(groups, routes=self.router_replay)
        if len(rows):
            metrics |= self.policy.train_step(rows, self.objective, self.policy.lr)
        else:
            metrics["loss"] = 0.0
            self.policy.version += 1
        staleness = [self.policy.version - 1 - g.policy_version for g in groups]
        return metrics | {"staleness_max": float(max(staleness))}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.policy.state_dict()

    def close(self) -> None:
        self.policy.optimizer.zero_grad(set_to_none=True)


@dataclass
class GrpoRun:
    steps: int = 0
    samples: int = 0
    tokens: int = 0  # sampled by the policy in the trained episodes (every turn)
    wall_s: float = 0.0
    trainer_idle: float = 0.0  # share of the wall time the trainer waited for groups
    fleet: dict[str, Any] = field(default_factory=dict)  # the job ledger and bytes shipped
    history: list[dict[str, float]] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, validation pass@1)
    keep_best: bool = False
    best: KeptVersion | None = None  # with keep_best: the best-scoring version so far

    def add_eval(self, outcomes: list[TaskOutcome], version: int,
                 weights: dict[str, torch.Tensor]) -> float:
        """Record a validation evaluation of `weights` (policy version `version`) at the
        current step; returns its pass@1."""
        score = pass_rate(outcomes)
        self.evals.append((self.steps, score))
        # a later version must score strictly higher: a tie carries no evidence, and the
        # earlier version has drifted less from a start GRPO tends to erode
        if self.keep_best and (self.best is None or score > self.best.score):
            self.best = KeptVersion(self.steps, version, score, weights)
        return score

    @property
    def samples_per_s(self) -> float:
        return self.samples / max(1e-9, self.wall_s)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(1e-9, self.wall_s)

    def final_reward(self, last: int = 5) -> float:
        rewards = [h["reward"] for h in self.history[-last:]]
        return sum(rewards) / max(1, len(rewards))


def run_grpo(policy: Policy, cfg: BootstrapSettings, train: list[Task],
             validation: list[Task], *, cache: SandboxCache, metrics_path: Path | None = None,
             eval_engine: TorchEngine | None = None, progress: bool = True,
             trackers: Trackers | None = None, kafka: KafkaConfig | None = None,
             work_dir: Path | None = None, batch_invariant: bool = False,
             local: LocalFleet | None = None) -> GrpoRun:
    """GRPO on the rollout fleet until `max_steps` (or `time_budget_s`). With an `eval_engine`,
    scores `validation` at the start and every `eval_every` steps, and keeps the best-scoring
    version in the run if `keep_best`. On `local` (default: `open_local_fleet` over `kafka`
    and `work_dir` for this call), with its worker processes plus any `flywheel rollout-worker`
    that joins."""
    with contextlib.ExitStack() as stack:
        if local is None:
            local = stack.enter_context(open_local_fleet(
                cfg, kafka=kafka, work_dir=work_dir, batch_invariant=batch_invariant))
        kafka, work_dir = local.kafka, local.work_dir
        store = build_artifact_store(artifact_store_config(local.store_url))
        publisher = PolicyPublisher(store, kafka).start(
            policy.version, policy.state_dict(), model_files(policy.served.model, policy.tokenizer))
        stack.callback(publisher.close)
        fleet = RolloutFleet(kafka, cfg, TaskSampler(train, floor=cfg.solved_task_weight),
                             publisher, first_step=policy.version, steps=cfg.max_steps,
                             health=local.workers.check)
        run = GrpoRun(keep_best=cfg.keep_best)
        try:
            _train(policy, cfg, fleet, run, validation, cache=cache, metrics_path=metrics_path,
                   eval_engine=eval_engine, progress=progress, trackers=trackers)
        finally:
            run.fleet = fleet.close(work_dir / "jobs.jsonl") | {
                "delta_bytes_per_version": publisher.delta_bytes(),
                "full_bytes_per_version": publisher.full_bytes}
    return run


def _train(policy: Policy, cfg: BootstrapSettings, fleet: RolloutFleet, run: GrpoRun,
           validation: list[Task], *, cache: SandboxCache, metrics_path: Path | None,
           eval_engine: TorchEngine | None, progress: bool, trackers: Trackers | None) -> None:
    from tqdm import tqdm

    trainer = OfflineTrainer.from_settings(policy, cfg)
    scoring = eval_engine is not None and bool(validation)

    def score(weights: dict[str, torch.Tensor]) -> float:
        assert eval_engine is not None
        load_weights(eval_engine, policy.version, weights)
        return run.add_eval(evaluate(eval_engine, cfg, validation, cache), policy.version,
                            weights)

    if scoring:  # the start (mid-trained) is a candidate too; outside GRPO's time budget
        score(trainer.state_dict())
    start = time.monotonic()
    budget = cfg.time_budget_s
    # the run ends at max_steps, or at its time budget where it has one: the bar counts that
    bar = tqdm(total=cfg.max_steps if budget is None else round(budget), desc="grpo",
               unit="step" if budget is None else "s", disable=not progress,
               dynamic_ncols=True, mininterval=1.0)
    try:
        for step in range(policy.version, policy.version + cfg.max_steps):
            elapsed = time.monotonic() - start
            if budget is not None and elapsed > budget:
                break
            groups = fleet.take_step(step)
            spent = max(elapsed / budget if budget else 0.0,
                        run.steps / cfg.max_steps)  # of the run's budget
            lr = cfg.lr * cosine_factor(spent, floor=cfg.lr_floor)
            policy.set_lr(lr)
            metrics = trainer.step(groups)
            state = trainer.state_dict()
            fleet.publisher.publish(policy.version, state)
            run.steps += 1
            run.samples += sum(len(g.trajectories) for g in groups)
            run.tokens += sum(int(t.loss_mask.unpack().sum()) for g in groups
                              for t in g.trajectories)
            record = {"step": run.steps, "wall_s": time.monotonic() - start, "lr": lr} | metrics
            if scoring and run.steps % cfg.eval_every == 0:
                record["validation_pass_at_1"] = score(state)
            run.history.append(record)
            if metrics_path is not None:
                append_metrics(metrics_path, record)
            if trackers is not None:
                trackers.report(run.steps, record)
            bar.update(min(bar.total, run.steps if budget is None else round(record["wall_s"]))
                       - bar.n)
            bar.set_postfix(step=run.steps, reward=f"{metrics['reward']:.2f}",
                            solved=f"{metrics['solved']:.2f}", refresh=False)
        if scoring and run.evals[-1][0] != run.steps:  # the last version is a candidate too
            score(trainer.state_dict())
    finally:
        run.wall_s = time.monotonic() - start
        run.trainer_idle = fleet.idle_s / max(1e-9, run.wall_s)
        bar.close()
        trainer.close()


def run_bootstrap(cfg: BootstrapSettings, model_dir: Path, run_dir: Path, *,
                  progress: bool = True, batch_invariant: bool = False,
                  world: World | None = None, trackers: TrackerSettings | None = None,
                  kafka: KafkaConfig | None = None,
                  worker_module: str = "simulate.rollout_worker") -> dict[str, Any]:
    """Mid-train, measure held-out pass@1, GRPO, measure again; write everything to run_dir.
    `batch_invariant`: trainer and rollout engines run kernels/batch_invariant's ops. Over
    the ranks of `world` the policy is sharded; the leader runs everything else (tasks,
    rollout workers, evals, files), the others follow its training, then return {}. `trackers`:
    where step metrics go besides metrics.jsonl (default: TensorBoard under run_dir). `kafka`:
    the fleet's broker (default: an embedded one for the run). `worker_module`: what the
    local rollout workers run (`open_local_fleet`)."""
    torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)
    policy = Policy.load(model_dir, lr=cfg.midtrain_lr, world=world,
                         batch_invariant=batch_invariant)
    if not policy.world.leader:
        policy.follow()
        return {}
    try:  # the workers start now: their start overlaps mid-training
        with open_local_fleet(cfg, kafka=kafka, work_dir=run_dir,
                              batch_invariant=batch_invariant,
                              worker_module=worker_module) as local:
            return _bootstrap(policy, cfg, run_dir, local, progress=progress,
                              trackers=trackers or TrackerSettings())
    finally:
        policy.finish()


def _bootstrap(policy: Policy, cfg: BootstrapSettings, run_dir: Path, local: LocalFleet, *,
               progress: bool, trackers: TrackerSettings) -> dict[str, Any]:
    from simulate.sandbox_service import sandbox_runner
    from simulate.tasks import build_task_source
    from trainer.bootstrap.midtrain import (
        corpus_tasks,
        midtrain_on,
        quality_stop,
        rl_tasks,
        validation_tasks,
    )

    start = time.monotonic()
    run_dir.mkdir(parents=True, exist_ok=True)
    source = build_task_source(cfg.tasks)
    train, held_out = source.split("train"), source.split("held_out")
    random.Random(cfg.seed).shuffle(held_out)
    family = source.split("held_out_family")  # kinds of task never trained on
    mid = midtrain_on(policy, cfg, corpus_tasks(cfg, source, train),
                      stop=quality_stop(cfg, source), progress=progress)
    cache = SandboxCache(sandbox_runner(cfg.sandbox_url))
    eval_engine = make_engine(policy, cfg, seed=cfg.seed)
    tracked = build_trackers(trackers, "bootstrap", run_dir,
                             params=cfg.model_dump(mode="json", exclude={"tasks"}))
    try:
        start_eval = evaluate(eval_engine, cfg, held_out, cache)
        before = pass_rate(start_eval)
        midtrain_s = time.monotonic() - start
        run = run_grpo(policy, cfg, rl_tasks(cfg, source, train), validation_tasks(cfg, source),
                       cache=cache, eval_engine=eval_engine, local=local,
                       metrics_path=run_dir / "metrics.jsonl", progress=progress,
                       trackers=tracked)
        last = policy.state_dict()
        kept = run.best or KeptVersion(run.steps, policy.version, math.nan, last)
        load_weights(eval_engine, kept.version, kept.weights)
        end_eval = evaluate(eval_engine, cfg, held_out, cache)
        after = last_after = pass_rate(end_eval)
        family_end = evaluate(eval_engine, cfg, family, cache)
        if kept.version != policy.version:  # what the last version scores: reported, not used
            load_weights(eval_engine, policy.version, last)
            last_after = pass_rate(evaluate(eval_engine, cfg, held_out, cache))
    finally:
        tracked.close()
        eval_engine.close()
    save_version(policy, kept, run_dir / "model")
    plot_run(run.history, run.evals, (before, after, kept.step), run_dir / "reward.png")
    changes = write_outcomes(run_dir / "held_out.jsonl", start_eval, end_eval)
    write_final_outcomes(run_dir / "held_out_family.jsonl", family_end)
    family_after = pass_rate(family_end) if family else None
    flagged = int(sum(h.get("cheating_flagged", 0.0) for h in run.history))
    summary = {"pass_at_1_before": before, "pass_at_1_after": after,
               "family_pass_at_1_after": family_after,
               "steps": run.steps,
               "cheating_flagged": flagged, **mean_episode_shape(run.history)}
    summary["wall_s"] = round(time.monotonic() - start, 1)
    details = summary | {"midtrain_steps": mid.steps, "midtrain_loss": mid.final_loss,
                         "midtrain_checks": mid.checks,
                         "midtrain_and_eval_s": midtrain_s,
                         "samples": run.samples, "samples_per_s": run.samples_per_s,
                         "trainer_idle": run.trainer_idle, "fleet": run.fleet,
                         "validation_evals": run.evals, "kept_step": kept.step,
                         "kept_validation_pass_at_1": run.best and run.best.score,
                         "last_step_pass_at_1": last_after,
                         "held_out_tasks": min(len(held_out), cfg.eval_tasks),
                         "family_tasks": min(len(family), cfg.eval_tasks),
                         "held_out_changes": changes,
                         "sandbox_cache_hits": cache.hits, "sandbox_runs": cache.misses,
                         "settings": json.loads(cfg.model_dump_json())}
    (run_dir / "summary.json").write_text(json.dumps(details, indent=2))
    return summary

