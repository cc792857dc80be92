"""Mid-training: next-token prediction on transcripts of the train tasks, as the harness shows them.

Each train task (and each practice task of the source: the built-in templates filled with
values no task uses, so that the model learns to copy a parameter rather than recall it)
becomes the episode a good agent would have (`simulate/demonstrations.py`). The
loss covers the assistant turns only (the tokens the policy will later be asked to produce), so
the tiny model learns the tool format and some solutions; RL then has to get the held-out
parameter values right.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from simulate.demonstrations import first_call, windows
from simulate.harness import ChatTokens
from simulate.tasks import Task, split_of
from trainer.policy import NextTokenLoss, Policy, Rows

if TYPE_CHECKING:
    import torch

    from simulate.tasks import TaskSource
    from trainer.bootstrap.config import BootstrapSettings


def lr_factor(step: int, steps: int, *, warmup: int = 10, floor: float = 0.1) -> float:
    """Linear warm-up, then cosine decay to `floor`: a high peak rate without early blow-ups,
    and quiet last steps that do not undo the early ones."""
    if step < warmup:
        return (step + 1) / warmup
    return cosine_factor((step - warmup) / max(1, steps - warmup), floor=floor)


def cosine_factor(progress: float, *, floor: float) -> float:
    """1 at progress 0, down a half cosine to `floor` at progress 1 (and after)."""
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@dataclass(frozen=True)
class QualityStop:
    """Mid-training's early stop: every `every` steps, the mean probability that the model,
    sampling at `temperature`, writes the demonstration's first call of each of `tasks` (tasks
    it is not trained on, so this is copying, not recall); mid-training stops at the first
    check that reaches `target`. One forward pass a check, no episodes run: a lower bound of
    one-turn pass@1 at that temperature (another correct call, or a retry, also passes)."""

    tasks: list[Task]
    target: float
    temperature: float
    every: int

    def rows(self, chat: ChatTokens) -> Rows:
        """The tasks' openings and first calls, the mask on the calls (the same every check)."""
        calls = [first_call(chat, t) for t in self.tasks]
        return Rows([c[0] for c in calls], [c[1] for c in calls])

    def score(self, policy: Policy, rows: Rows) -> float:
        """The mean probability of writing `rows`' masked calls (`rows(chat)`)."""
        probs = policy.written_probability(rows, self.temperature)
        return sum(probs) / len(probs)


@dataclass(frozen=True)
class DemonstrationCorpus:
    """Every context window of the tasks' demonstrations, and how often each is drawn."""

    windows: list[tuple[list[int], list[int]]]  # (token ids, loss mask)
    cumulative: list[float] | None  # running sum of the windows' draw weights; None: all 1

    @classmethod
    def of(cls, chat: ChatTokens, tasks: list[Task], *, family_weights: dict[str, float],
           context_budget: int | None = None, max_summaries: int = 0) -> DemonstrationCorpus:
        """A window of a task whose family is in `family_weights` is drawn that many times as
        often as one of another family (weight 1)."""
        pairs = [(window, family_weights.get(t.family or "", 1.0))
                 for t in tasks if t.demonstrable
                 for window in windows(chat, t, context_budget=context_budget,
                                       max_summaries=max_summaries)]
        uniform = all(weight == 1.0 for _, weight in pairs)
        return cls([window for window, _ in pairs],
                   None if uniform else list(itertools.accumulate(w for _, w in pairs)))

    def draw(self, rng: random.Random, k: int) -> Rows:
        """`k` windows drawn with replacement by their weights (uniform ones drawn as before
        there were weights: the same windows for the same seed)."""
        if self.cumulative is None:
            drawn = [self.windows[rng.randrange(len(self.windows))] for _ in range(k)]
        else:
            drawn = rng.choices(self.windows, cum_weights=self.cumulative, k=k)
        return Rows([ids for ids, _ in drawn], [mask for _, mask in drawn])


@dataclass
class MidTrainResult:
    steps: int  # run: fewer than asked when a QualityStop stopped it
    final_loss: float
    checks: list[tuple[int, float]] = field(default_factory=list)  # (step, QualityStop score)


def midtrain(policy: Policy, chat: ChatTokens, tasks: list[Task], *, steps: int, batch_size: int,
             lr: float, lr_floor: float = 0.1, seed: int = 0, stop: QualityStop | None = None,
             progress: bool = False, context_budget: int | None = None,
             max_summaries: int = 0,
             family_weights: dict[str, float] | None = None) -> MidTrainResult:
    """`steps` AdamW steps (fewer if `stop` is reached) of masked next-token loss over
    demonstration transcripts drawn at random, each context window a row (a long task's episode
    summarizes past `context_budget` as the harness would, at most `max_summaries` times), a
    task of a family in `family_weights` drawn that many times as often as one of another
    family; the rate warms up to `lr`, then decays by cosine to `lr_floor` x `lr` (1.0:
    constant)."""
    from tqdm import tqdm

    corpus = DemonstrationCorpus.of(chat, tasks, family_weights=family_weights or {},
                                    context_budget=context_budget, max_summaries=max_summaries)
    rng = random.Random(seed)
    checked = stop.rows(chat) if stop is not None else None
    result = MidTrainResult(steps=0, final_loss=float("nan"))
    bar = tqdm(range(steps), desc="mid-training", disable=not progress, dynamic_ncols=True,
               mininterval=1.0)
    for step in bar:
        metrics = policy.train_step(corpus.draw(rng, batch_size), NextTokenLoss(),
                                    lr * lr_factor(step, steps, floor=lr_floor))
        result.steps, result.final_loss = step + 1, metrics["loss"]
        if stop is not None and checked is not None and result.steps % stop.every == 0:
            score = stop.score(policy, checked)
            result.checks.append((result.steps, score))
            bar.set_postfix(written=f"{score:.1%}")
            if score >= stop.target:
                break
    bar.close()
    policy.version = 0  # mid-training produces the start policy: version 0 of the RL run
    return result


@dataclass
class MidTrainedStart:
    """One mid-trained set of weights that several runs start from (the benches compare
    schedules or trainers from the very same start)."""

    model_dir: Path
    state: dict[str, torch.Tensor]
    train: list[Task]
    held_out: list[Task]
    steps: int

    def policy(self, *, lr: float) -> Policy:
        """A fresh policy (its own optimizer) holding the mid-trained weights."""
        policy = Policy.load(self.model_dir, lr=lr)
        policy.load_weights(self.state)
        return policy


def midtrained_start(cfg: BootstrapSettings, model_dir: Path, *,
                     steps: int | None = None) -> MidTrainedStart:
    """Split `cfg.tasks`, mid-train the model in `model_dir` on the corpus of the train split
    (`corpus_tasks`: with the practice tasks if asked) for `steps` (default
    `cfg.midtrain_steps`) and keep a copy of the weights."""
    from simulate.tasks import build_task_source

    source = build_task_source(cfg.tasks)
    train, held_out = source.split("train"), source.split("held_out")
    steps = cfg.midtrain_steps if steps is None else steps
    policy = Policy.load(model_dir, lr=cfg.midtrain_lr)
    midtrain_on(policy, cfg, corpus_tasks(cfg, source, train), steps=steps)
    return MidTrainedStart(model_dir, policy.state_dict(), train, held_out, steps)


def held_back(task: Task, fraction: float) -> bool:
    """Whether a practice task is kept out of mid-training for GRPO: a pure function of its id,
    like the splits."""
    return split_of(task.task_id + "#grpo", fraction) == "held_out"


def corpus_tasks(cfg: BootstrapSettings, source: TaskSource, train: list[Task]) -> list[Task]:
    """The mid-training corpus: the train split, plus the source's practice tasks if asked
    (less those held back for GRPO)."""
    practice = source.practice_tasks() if cfg.midtrain_practice else []
    return train + [t for t in practice if not held_back(t, cfg.grpo_practice_fraction)]


def rl_tasks(cfg: BootstrapSettings, source: TaskSource, train: list[Task]) -> list[Task]:
    """GRPO's task pool: the train split, plus the practice tasks held back from mid-training
    (values the model has not memorized, so a reward needs the parameter copied from the
    docstring), less the validation tasks."""
    validation = {t.task_id for t in validation_tasks(cfg, source)}
    return train + [t for t in source.practice_tasks()
                    if held_back(t, cfg.grpo_practice_fraction) and t.task_id not in validation]


def unseen_tasks(cfg: BootstrapSettings, source: TaskSource) -> list[Task]:
    """Practice tasks mid-training never shows (those held back for GRPO, or all of them when
    the corpus has none), with a solution: in the source's order."""
    practice = source.practice_tasks()
    if cfg.midtrain_practice:
        practice = [t for t in practice if held_back(t, cfg.grpo_practice_fraction)]
    return [t for t in practice if t.canonical_solution]


def validation_tasks(cfg: BootstrapSettings, source: TaskSource) -> list[Task]:
    """`validation_tasks` of the unseen tasks, drawn by a hash of their ids so that every
    template has its share (the source lists them template by template): what neither
    mid-training nor GRPO trains on, and the bootstrap keeps its best version by."""
    unseen = unseen_tasks(cfg, source)
    unseen.sort(key=lambda t: hashlib.sha256(f"{t.task_id}#validation".encode()).digest())
    return unseen[:cfg.validation_tasks]


def quality_stop(cfg: BootstrapSettings, source: TaskSource) -> QualityStop | None:
    """The settings' early stop (`midtrain_until`), or None."""
    if cfg.midtrain_until is None:
        return None
    tasks = unseen_tasks(cfg, source)[:cfg.eval_tasks]
    if not tasks:
        raise ValueError("midtrain_until needs practice tasks that mid-training does not see: "
                         "set grpo_practice_fraction above 0 or midtrain_practice false")
    return QualityStop(tasks, cfg.midtrain_until, cfg.midtrain_check_temperature,
                       cfg.midtrain_check_every)


def midtrain_on(policy: Policy, cfg: BootstrapSettings, tasks: list[Task], *,
                steps: int | None = None, stop: QualityStop | None = None,
                progress: bool = False) -> MidTrainResult:
    """`midtrain` with the settings' batch, rate, schedule and threads (`midtrain_threads`,
    then back to the threads the caller had)."""
    import os

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.midtrain_threads or os.cpu_count() or threads)
    try:
        return midtrain(policy, ChatTokens(policy.tokenizer), tasks,
                        steps=cfg.midtrain_steps if steps is None else steps,
                        batch_size=cfg.midtrain_batch, lr=cfg.midtrain_lr,
                        lr_floor=cfg.midtrain_lr_floor, seed=cfg.seed, stop=stop,
                        progress=progress, context_budget=cfg.context_budget,
                        max_summaries=cfg.max_summaries,
                        family_weights=cfg.midtrain_family_weights)
    finally:
        torch.set_num_threads(threads)
