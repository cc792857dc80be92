"""The eval gate: a release candidate ships only if it does not regress on a fixed suite.

A suite scores a model (a dict of metrics) and names the one the gate compares (`metric`,
higher or lower better); `gate` refuses a candidate whose metric is worse than the served
version's by more than the tolerance. Suites:

- `HeldOutTasksSuite` (the default): greedy pass@1 of the multi-turn tool agent (the
  bootstrap's harness, in the sandbox) on the held-out split of the task source: tasks never
  served to the product and never trained on. It guards the ability users rely on; the
  tolerance is in points of pass@1.
- `HeldOutLossSuite`: mean next-token loss on held-out Python source (stdlib modules the
  default tokenizer and model never saw): a guard for a model with no task suite.
- `CallableSuite`: any `fn(model, tokenizer) -> dict[str, float]`.

    suite = build_eval_suite(settings.release.eval, tasks=..., harness=...)
    decision = gate(suite, suite.evaluate(candidate, tok), suite.evaluate(served, tok))
"""

from __future__ import annotations

import asyncio
import importlib
import sysconfig
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simulate.harness import Harness, HarnessConfig
from simulate.rollouts import SandboxCache, pass_rate, run_once
from simulate.tasks import TaskSourceConfig, build_task_source
from trainer.release_config import CallableEval, EvalSettings, HeldOutLossEval, HeldOutTasksEval

# Disjoint from trainer.init_model._STDLIB_MODULES (the tokenizer's training corpus).
HELD_OUT_MODULES = ["shutil", "tempfile", "glob", "fnmatch", "gzip", "zipfile", "tarfile",
                    "ipaddress", "smtplib", "ftplib"]


class EvalError(RuntimeError):
    """The suite could not score a model (the message says why)."""


@dataclass(frozen=True)
class GateDecision:
    passed: bool
    reason: str
    candidate: dict[str, float]
    served: dict[str, float]

    def summary(self) -> dict[str, float]:
        out = {f"candidate_{k}": v for k, v in self.candidate.items()}
        out.update({f"served_{k}": v for k, v in self.served.items()})
        return out


class EvalSuite(ABC):
    """Scores a model; the gate compares `metric` within `tolerance`."""

    metric: str = "loss"
    higher_is_better: bool = False
    tolerance: float = 0.0

    @abstractmethod
    def evaluate(self, model: Any, tokenizer: Any) -> dict[str, float]:
        """Metrics of `model`; must include `metric`."""

    def describe(self, value: float) -> str:
        return f"{value:.4f}"


class HeldOutTasksSuite(EvalSuite):
    """Greedy pass@1 on the held-out tasks, one episode each (`simulate.rollouts.run_once`)."""

    metric, higher_is_better = "pass_at_1", True

    def __init__(self, cfg: HeldOutTasksEval, *, tasks: TaskSourceConfig,
                 harness: HarnessConfig) -> None:
        self.tasks = build_task_source(tasks).split("held_out")[:cfg.max_tasks]
        if not self.tasks:
            raise EvalError("the task source has no held-out tasks to gate on")
        self.harness = HarnessConfig(max_turns=harness.max_turns, max_tokens=harness.max_tokens,
                                     context_budget=harness.context_budget, temperature=0.0)
        self.tolerance = cfg.max_drop_points / 100.0
        self.cache = SandboxCache()  # tests are deterministic: reuse verdicts across models

    def evaluate(self, model: Any, tokenizer: Any) -> dict[str, float]:
        from serving.torch_engine import TorchEngine

        engine = TorchEngine(model, tokenizer, max_batch=128)
        try:
            outcomes = asyncio.run(run_once(Harness.on_engine(engine, self.harness),
                                            self.tasks, cache=self.cache))
        finally:
            engine.close()
        return {"pass_at_1": pass_rate(outcomes), "tasks": float(len(outcomes))}

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

    def evaluate(self, model: Any, tokenizer: Any) -> dict[str, float]:
        import torch

        windows = self.windows(tokenizer)
        losses = []
        with torch.inference_mode():
            for row in windows.split(4):
                losses.append(float(model(input_ids=row, labels=row).loss) * len(row))
        return {"loss": sum(losses) / len(windows), "tokens": float(windows.numel())}


class CallableSuite(EvalSuite):
    def __init__(self, cfg: CallableEval) -> None:
        module, _, name = cfg.path.partition(":")
        self.fn: Callable[[Any, Any], dict[str, float]] = getattr(
            importlib.import_module(module), name)
        self.metric, self.higher_is_better = cfg.metric, cfg.higher_is_better
        self.tolerance = cfg.max_regression

    def evaluate(self, model: Any, tokenizer: Any) -> dict[str, float]:
        metrics = {k: float(v) for k, v in self.fn(model, tokenizer).items()}
        if self.metric not in metrics:
            raise EvalError(f"the eval callable returned no {self.metric!r}")
        return metrics


def build_eval_suite(cfg: EvalSettings, *, tasks: TaskSourceConfig,
                     harness: HarnessConfig) -> EvalSuite:
    """The suite `cfg` names; `tasks` and `harness` are the bootstrap's (held-out tasks)."""
    if isinstance(cfg, HeldOutTasksEval):
        return HeldOutTasksSuite(cfg, tasks=tasks, harness=harness)
    if isinstance(cfg, CallableEval):
        return CallableSuite(cfg)
    return HeldOutLossSuite(cfg)


def gate(suite: EvalSuite, candidate: dict[str, float], served: dict[str, float]
         ) -> GateDecision:
    """Pass unless the candidate's metric is worse than the served one's by more than the
    suite's tolerance."""
    name, was, now = suite.metric, served[suite.metric], candidate[suite.metric]
    worse = (was - now) if suite.higher_is_better else (now - was)
    change = f"{name} {suite.describe(was)} -> {suite.describe(now)}"
    if worse > suite.tolerance:
        return GateDecision(False, f"{change}: worse by {suite.describe(worse)}, more than "
                                   f"the {suite.describe(suite.tolerance)} allowed",
                            candidate, served)
    return GateDecision(True, change, candidate, served)


def held_out_texts() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / f"{m}.py").read_text(encoding="utf-8", errors="replace")
            for m in HELD_OUT_MODULES if (root / f"{m}.py").exists()]
