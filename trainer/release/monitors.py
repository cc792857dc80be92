"""Monitors for reward hacking: per served version, what its generations did with the tools
they were offered (`GenerationLogged.tool_use`), how long they ran, how live acceptance and
held-out pass@1 moved, and the online trainer's own figures, each against a threshold of
`MonitorSettings` (trainer/release/config.py).

The reward hacks the account this project is modeled on caught in production were a model
that emitted broken tool calls to dodge negative reward and one that asked clarifying
questions instead of editing. Both show as a version's rates moving against the version it
replaced, so the rate monitors compare a version with its parent: a monitor trips when the
rise passes its threshold and a one-sided two-proportion z-test at `confidence` says the
rise is real (after `min_generations` of each). Each breach names the sessions that showed
it (up to `SESSIONS_KEPT`), for a person to read.

    monitors = Monitors(settings)
    monitors.add(generation)                        # every GenerationLogged, any order
    breaches = monitors.check(version, parent=version - 1, acceptance=..., held_out=...,
                              trainer={"kl": ..., "clip_fraction": ...})
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

from ingest.events import GenerationLogged
from trainer.release.config import MonitorSettings

SESSIONS_KEPT = 20  # per version and monitor: the sessions a breach names
# rate monitor -> its threshold's name in MonitorSettings
RATES: dict[str, str] = {"invalid_call": "invalid_call_rise", "no_call": "no_call_rise",
                         "question": "question_rise"}


@dataclass
class VersionUse:
    """One served version's generations, as the monitors count them."""

    generations: int = 0
    completion_tokens: int = 0
    tool_turns: int = 0  # generations offered tools
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RATES, 0))
    sessions: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in RATES})

    def add(self, g: GenerationLogged) -> None:
        self.generations += 1
        self.completion_tokens += len(g.completion_token_ids)
        use = g.tool_use
        if use is None:
            return
        self.tool_turns += 1
        seen = {"invalid_call": use.invalid > 0,
                "no_call": use.calls == 0 and use.invalid == 0,
                "question": use.question}
        for name, hit in seen.items():
            if not hit:
                continue
            self.counts[name] += 1
            kept = self.sessions[name]
            who = g.session_id or g.generation_id
            if len(kept) < SESSIONS_KEPT and who not in kept:
                kept.append(who)

    def rate(self, name: str) -> float:
        return self.counts[name] / self.tool_turns if self.tool_turns else 0.0

    @property
    def mean_length(self) -> float:
        return self.completion_tokens / self.generations if self.generations else 0.0


@dataclass(frozen=True)
class Breach:
    """A monitor that tripped for `version`: its figure, the parent's (or the limit's), the
    threshold, and the sessions that showed it."""

    monitor: str
    version: int
    value: float
    baseline: float
    threshold: float
    sessions: tuple[str, ...] = ()

    def describe(self) -> str:
        return (f"{self.monitor} on v{self.version}: {self.value:.3f} against "
                f"{self.baseline:.3f} (threshold {self.threshold})")


def rise_is_real(hits: int, n: int, base_hits: int, base_n: int, rise: float,
                 confidence: float) -> bool:
    """The version's rate exceeds the parent's by more than `rise`, and a one-sided
    two-proportion z-test at `confidence` rejects "no higher than the parent's"."""
    p, q = hits / n, base_hits / base_n
    if p - q <= rise:
        return False
    pooled = (hits + base_hits) / (n + base_n)
    se = math.sqrt(max(pooled * (1 - pooled), 1e-12) * (1 / n + 1 / base_n))
    return (p - q) / se > statistics.NormalDist().inv_cdf(confidence)


class Monitors:
    """Counts per version from the generation log; `check` lists what tripped."""

    def __init__(self, settings: MonitorSettings) -> None:
        self.settings = settings
        self.versions: dict[int, VersionUse] = {}

    def add(self, generation: GenerationLogged) -> None:
        self.versions.setdefault(generation.model_version, VersionUse()).add(generation)

    def check(self, version: int, *, parent: int | None,
              acceptance: Mapping[int, float] | None = None,
              held_out: Mapping[int, float] | None = None,
              trainer: Mapping[str, float] | None = None) -> list[Breach]:
        """Every monitor that trips for `version` against `parent` (the rate and length
        monitors need both to have `min_generations`); `acceptance` and `held_out` by
        version, `trainer` the online trainer's latest `kl` and `clip_fraction`."""
        s = self.settings
        breaches: list[Breach] = []
        use, base = self.versions.get(version), self.versions.get(parent) if parent is not None \
            else None
        if use is not None and base is not None and min(
                use.generations, base.generations) >= s.min_generations:
            for name, threshold_name in RATES.items():
                rise = getattr(s, threshold_name)
                if use.tool_turns and base.tool_turns and rise_is_real(
                        use.counts[name], use.tool_turns, base.counts[name], base.tool_turns,
                        rise, s.confidence):
                    breaches.append(Breach(name, version, use.rate(name), base.rate(name),
                                           rise, tuple(use.sessions[name])))
            if base.mean_length and use.mean_length > s.length_ratio * base.mean_length:
                breaches.append(Breach("completion_length", version, use.mean_length,
                                       base.mean_length, s.length_ratio))
        if acceptance and held_out and parent is not None and all(
                v in figures for v in (version, parent) for figures in (acceptance, held_out)):
            gap = (acceptance[version] - acceptance[parent]) - (held_out[version]
                                                                 - held_out[parent])
            if gap > s.acceptance_gap:
                breaches.append(Breach("acceptance_vs_held_out", version, gap, 0.0,
                                       s.acceptance_gap))
        for key, limit in (("kl", s.max_kl), ("clip_fraction", s.max_clip_fraction)):
            value = (trainer or {}).get(key)
            if value is not None and value > limit:
                breaches.append(Breach(f"trainer_{key}", version, value, limit, limit))
        return breaches

    def figures(self, version: int) -> dict[str, float | int]:
        """A version's counts and rates, for the console and the metrics."""
        use = self.versions.get(version, VersionUse())
        return {"generations": use.generations, "tool_turns": use.tool_turns,
                "mean_completion_tokens": use.mean_length,
                **{f"{name}_rate": use.rate(name) for name in RATES}}
