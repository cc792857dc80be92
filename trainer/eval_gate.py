"""The eval gate: a release candidate ships only if it does not regress on a fixed suite.

A suite scores a model (a dict of metrics, `loss` lower is better); `gate` compares the
candidate with the served version and rejects a rise of `loss` beyond the tolerance. The
default suite is mean next-token loss on held-out Python source (stdlib modules the default
tokenizer and model never saw); `CallableEval` plugs in any scorer, such as the held-out
simulate tasks of #6 once they exist.

    suite = build_eval_suite(settings.release.eval)
    decision = gate(suite.evaluate(candidate, tok), suite.evaluate(served, tok),
                    max_regression=settings.release.eval.max_regression)
"""

from __future__ import annotations

import importlib
import sysconfig
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.release_config import CallableEval, EvalSettings, HeldOutLossEval

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
    @abstractmethod
    def evaluate(self, model: Any, tokenizer: Any) -> dict[str, float]:
        """Metrics of `model`; must include `loss` (lower is better)."""


class HeldOutLossSuite(EvalSuite):
    """Mean next-token cross-entropy over fixed windows of held-out text."""

    def __init__(self, cfg: HeldOutLossEval) -> None:
        self.cfg = cfg
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

    def evaluate(self, model: Any, tokenizer: Any) -> dict[str, float]:
        metrics = {k: float(v) for k, v in self.fn(model, tokenizer).items()}
        if "loss" not in metrics:
            raise EvalError("the eval callable returned no 'loss'")
        return metrics


def build_eval_suite(cfg: EvalSettings) -> EvalSuite:
    if isinstance(cfg, CallableEval):
        return CallableSuite(cfg)
    return HeldOutLossSuite(cfg)


def gate(candidate: dict[str, float], served: dict[str, float], *,
         max_regression: float) -> GateDecision:
    """Pass unless the candidate's loss exceeds the served loss by more than the tolerance."""
    rise = candidate["loss"] - served["loss"]
    if rise > max_regression:
        return GateDecision(False, f"eval loss regressed by {rise:.4f} > {max_regression} "
                                   f"({served['loss']:.4f} -> {candidate['loss']:.4f})",
                            candidate, served)
    return GateDecision(True, f"eval loss {served['loss']:.4f} -> {candidate['loss']:.4f}",
                        candidate, served)


def held_out_texts() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / f"{m}.py").read_text(encoding="utf-8", errors="replace")
            for m in HELD_OUT_MODULES if (root / f"{m}.py").exists()]
