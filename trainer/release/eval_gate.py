"""The eval gate: a release candidate ships only if it is not shown to be worse on a suite.

A suite scores a model (`Scores`: metrics, and for a suite of tasks each task's score) and
names the metric the gate compares (`metric`, higher or lower better). Where both versions
have per-task scores on the same tasks, `gate` compares them task by task (a paired test):
it refuses the candidate only when the one-sided upper `confidence` bound of the mean change
is below -tolerance, so a candidate no worse than the tolerance is refused with probability
at most 1 - confidence, whatever noise the suite has. Otherwise it refuses a candidate whose
metric is worse by more than the tolerance. Suites:

- `HeldOutTasksSuite` (the default): pass@1 of the multi-turn tool agent (the bootstrap's
  harness, in the sandbox) on the held-out split of the task source, several sampled episodes
  per task: tasks never served to the product and never trained on. It guards the ability
  users rely on; the tolerance is in points of pass@1. `bench/gate.py` measures its error
  rates.
- `HeldOutLossSuite`: mean next-token loss on held-out Python source (stdlib modules the
  default tokenizer and model never saw): a guard for a model with no task suite.
- `CallableSuite`: any `fn(model, tokenizer) -> dict[str, float]`.

    suite = build_eval_suite(settings.release.eval, tasks=..., harness=...)
    decision = gate(suite, suite.evaluate(candidate, tok), suite.evaluate(served, tok))
"""

from __future__ import annotations

import asyncio
import importlib
import math
import statistics
import sysconfig
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simulate.harness import Harness, HarnessConfig
from simulate.rollouts import SandboxCache, run_once
from simulate.tasks import TaskSourceConfig, build_task_source
from trainer.release.config import CallableEval, EvalSettings, HeldOutLossEval, HeldOutTasksEval

# Disjoint from trainer.init_model._STDLIB_MODULES (the tokenizer's training corpus).
HELD_OUT_MODULES = ["shutil", "tempfile", "glob", "fnmatch", "gzip", "zipfile", "tarfile",
                    "ipaddress", "smtplib", "ftplib"]


class EvalError(RuntimeError):
    """The suite could not score a model (the message says why)."""


@dataclass(frozen=True)
class Scores:
    """A model's figures on a suite: `metrics` (holding the suite's metric) and, for a suite
    of tasks, each task's score by task id (the metric is their mean)."""

    metrics: dict[str, float]
    tasks: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PairedChange:
    """The candidate's mean per-task change against the served version (positive: better),
    its standard error and its one-sided upper `confidence` bound."""

    mean: float
    stderr: float
    upper: float
    tasks: int


@dataclass(frozen=True)
class GateDecision:
    passed: bool
    reason: str
    candidate: dict[str, float]
    served: dict[str, float]
    change: PairedChange | None = None

    def summary(self) -> dict[str, float]:
        out = {f"candidate_{k}": v for k, v in self.candidate.items()}
        out.update({f"served_{k}": v for k, v in self.served.items()})
        if self.change is not None:
            out.update({"change": self.change.mean, "change_upper": self.change.upper,
                        "change_stderr": self.change.stderr})
        return out


class EvalSuite(ABC):
    """Scores a model; the gate compares `metric` within `tolerance` (at `confidence` where
    the suite scores tasks)."""

    metric: str = "loss"
    higher_is_better: bool = False
    tolerance: float = 0.0
    confidence: float = 0.95

    @abstractmethod
    def evaluate(self, model: Any, tokenizer: Any) -> Scores:
        """Scores of `model`; its metrics include `metric`."""

    def describe(self, value: float) -> str:
        return f"{value:.4f}"


class HeldOutTasksSuite(EvalSuite):
    """pass@1 on the held-out tasks: `samples_per_task` episodes of each at `temperature`
    (`simulate.rollouts.run_once`), a task's score the share of its episodes that pass."""

    metric, higher_is_better = "pass_at_1", True

    def __init__(self, cfg: HeldOutTasksEval, *, tasks: TaskSourceConfig,
                 harness: HarnessConfig) -> None:
        self.tasks = build_task_source(tasks).split("held_out")[:cfg.max_tasks]
        if not self.tasks:
            raise EvalError("the task source has no held-out tasks to gate on")
        self.samples, self.seed = cfg.samples_per_task, cfg.seed
        self.harness = HarnessConfig(max_turns=harness.max_turns, max_tokens=harness.max_tokens,
                                     context_budget=harness.context_budget,
                                     max_summaries=harness.max_summaries,
                                     overflow=harness.overflow, temperature=cfg.temperature)
        self.tolerance, self.confidence = cfg.max_drop_points / 100.0, cfg.confidence
        self.cache = SandboxCache()  # tests are deterministic: reuse verdicts across models

    def evaluate(self, model: Any, tokenizer: Any) -> Scores:
        return self.evaluate_seeded(model, tokenizer, seed=self.seed)

    def evaluate_seeded(self, model: Any, tokenizer: Any, *, seed: int) -> Scores:
        """`evaluate` with the episodes' sampling seeds from `seed` (bench/gate.py draws
        independent evaluations of one model)."""
        from serving.torch_engine import TorchEngine

        n = len(self.tasks)
        engine = TorchEngine(model, tokenizer, max_batch=128)
        try:  # episode i is task i % n: its k-th sample sits at i + k * n
            outcomes = asyncio.run(run_once(Harness.on_engine(engine, self.harness),
                                            self.tasks * self.samples, cache=self.cache,
                                            seed=seed))
        finally:
            engine.close()
        per_task = {t.task_id: sum(o.passed for o in outcomes[i::n]) / self.samples
                    for i, t in enumerate(self.tasks)}
        return Scores({"pass_at_1": statistics.fmean(per_task.values()), "tasks": float(n),
                       "samples_per_task": float(self.samples)}, per_task)

    def describe(self, value: float) -> str:
        return f"{100 * value:.1f}%"


class HeldOutLossSuite(EvalSuite):
    """Mean next-token cross-entropy over fixed windows of held-out text."""

    def __init__(self, cfg: HeldOutLossEval) -> None:
        self.cfg = cfg
        self.tolerance = cfg.max_regression
        self._windows: Any = None

    def windows(self, tokenizer: Any) -> Any:  # (N, L) int64
        import torch

        if self._windows is None:
            ids: list[int] = []
            need = self.cfg.sequences * self.cfg.seq_len
            for text in held_out_texts():
                ids += tokenizer(text, add_special_tokens=False)["input_ids"]
                if len(ids) >= need:
                    break
            if len(ids) < need:
                raise EvalError(f"held-out text has {len(ids)} tokens, the suite needs {need}")
            self._windows = torch.tensor(ids[:need]).view(self.cfg.sequences, self.cfg.seq_len)
        return self._windows

    def evaluate(self, model: Any, tokenizer: Any) -> Scores:
        import torch

        windows = self.windows(tokenizer)
        losses = []
        with torch.inference_mode():
            for row in windows.split(4):
                losses.append(float(model(input_ids=row, labels=row).loss) * len(row))
        return Scores({"loss": sum(losses) / len(windows), "tokens": float(windows.numel())})


class CallableSuite(EvalSuite):
    def __init__(self, cfg: CallableEval) -> None:
        module, _, name = cfg.path.partition(":")
        self.fn: Callable[[Any, Any], dict[str, float]] = getattr(
            importlib.import_module(module), name)
        self.metric, self.higher_is_better = cfg.metric, cfg.higher_is_better
        self.tolerance = cfg.max_regression

    def evaluate(self, model: Any, tokenizer: Any) -> Scores:
        metrics = {k: float(v) for k, v in self.fn(model, tokenizer).items()}
        if self.metric not in metrics:
            raise EvalError(f"the eval callable returned no {self.metric!r}")
        return Scores(metrics)


def build_eval_suite(cfg: EvalSettings, *, tasks: TaskSourceConfig,
                     harness: HarnessConfig) -> EvalSuite:
    """The suite `cfg` names; `tasks` and `harness` are the bootstrap's (held-out tasks)."""
    if isinstance(cfg, HeldOutTasksEval):
        return HeldOutTasksSuite(cfg, tasks=tasks, harness=harness)
    if isinstance(cfg, CallableEval):
        return CallableSuite(cfg)
    return HeldOutLossSuite(cfg)


def gate(suite: EvalSuite, candidate: Scores, served: Scores) -> GateDecision:
    """Pass unless the candidate is worse than the served version by more than the suite's
    tolerance: shown so by the paired test where both have per-task scores on the same tasks
    (`paired_change`), by the bare metrics otherwise."""
    name, was, now = suite.metric, served.metrics[suite.metric], candidate.metrics[suite.metric]
    figures = f"{name} {suite.describe(was)} -> {suite.describe(now)}"
    allowed = suite.describe(suite.tolerance)
    if candidate.tasks and candidate.tasks.keys() == served.tasks.keys() \
            and len(candidate.tasks) > 1:
        sign = 1.0 if suite.higher_is_better else -1.0
        change = paired_change({k: sign * v for k, v in candidate.tasks.items()},
                               {k: sign * v for k, v in served.tasks.items()},
                               confidence=suite.confidence)
        bounds = (f"change {suite.describe(change.mean)} over {change.tasks} tasks, "
                  f"{suite.confidence:.0%} upper bound {suite.describe(change.upper)}")
        refused = change.upper < -suite.tolerance
        verdict = (f"worse by more than the {allowed} allowed" if refused
                   else f"not shown worse by more than {allowed}")
        return GateDecision(not refused, f"{figures}: {bounds}: {verdict}",
                            candidate.metrics, served.metrics, change)
    worse = (was - now) if suite.higher_is_better else (now - was)
    if worse > suite.tolerance:
        return GateDecision(False, f"{figures}: worse by {suite.describe(worse)}, more than "
                                   f"the {allowed} allowed", candidate.metrics, served.metrics)
    return GateDecision(True, figures, candidate.metrics, served.metrics)


def paired_change(candidate: dict[str, float], served: dict[str, float], *,
                  confidence: float) -> PairedChange:
    """Mean of the per-task differences candidate - served and its one-sided upper
    `confidence` bound by Student's t over the tasks: each task is one paired observation,
    so how hard the tasks are cancels and only how the two versions differ on them counts.
    At least two tasks."""
    diffs = [candidate[k] - served[k] for k in served]  # (n,)
    n = len(diffs)
    mean = statistics.fmean(diffs)
    stderr = statistics.stdev(diffs) / math.sqrt(n)
    return PairedChange(mean, stderr, mean + t_quantile(confidence, n - 1) * stderr, n)


def t_quantile(q: float, df: int) -> float:
    """Student's t quantile by the Cornish-Fisher expansion around the normal one (stdlib
    only): within 0.01 of the exact value from 4 degrees of freedom up, too small below."""
    z = statistics.NormalDist().inv_cdf(q)
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


def held_out_texts() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / f"{m}.py").read_text(encoding="utf-8", errors="replace")
            for m in HELD_OUT_MODULES if (root / f"{m}.py").exists()]
