"""The end of `flywheel demo` (app/cli/demo_loop.py): the table per served version, the
canaries' decisions, `D/demo.png`, `D/live/sessions.jsonl` and the one JSON line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from app.settings import Settings


def release_line(row: dict[str, Any]) -> str:
    summary = row.get("eval_summary") or {}
    figures = ""
    if "candidate_pass_at_1" in summary:
        figures = (f" held-out pass@1 {summary['served_pass_at_1']:.1%} -> "
                   f"{summary['candidate_pass_at_1']:.1%}")
    return f"release v{row['version']}: {row['status']}{figures} ({row['reason']})"


def held_out_by_version(releases: list[dict[str, Any]]) -> dict[int, float]:
    """Held-out pass@1 of every published version, from the eval gate's figures."""
    out: dict[int, float] = {}
    for row in releases:
        summary = row.get("eval_summary") or {}
        if "candidate_pass_at_1" not in summary:
            continue
        out.setdefault(int(row["parent"]), float(summary["served_pass_at_1"]))
        if row["status"] in ("published", "rolled_back"):
            out[int(row["version"])] = float(summary["candidate_pass_at_1"])
    return dict(sorted(out.items()))


def canary_decision(canary: dict[str, Any]) -> dict[str, Any]:
    """A canary for the JSON line: its decision and the acceptance test's figures."""
    f = canary["figures"].get("acceptance") or {}
    return {"version": canary["version"], "decision": canary["status"],
            "decided_by": canary["decided_by"],
            "candidate_sessions": f.get("candidate_sessions"),
            "incumbent_sessions": f.get("incumbent_sessions"),
            **{k: round(f[k], 4) for k in ("candidate_mean", "incumbent_mean", "difference",
                                           "low", "high") if k in f}}


def report(settings: Settings, population: Any, releases: list[dict[str, Any]],
           breaches: int, canaries: list[dict[str, Any]], wall_s: float) -> int:
    stats = population.stats
    by = {v: s for v, s in sorted(stats.by_version.items())}
    held_out = held_out_by_version(releases)
    # the gains are the newest published release's: a candidate the canary rolled back
    # served sessions too, and is shown, but it is not a release
    served = [0] + [r["version"] for r in releases
                    if r["version"] > 0 and r["status"] == "published"]
    print(f"\n{'version':>8} {'sessions':>9} {'accepted':>9} {'rate':>6} {'held-out':>9}")
    for v, s in by.items():
        figure = f"{held_out[v]:.1%}" if v in held_out else "-"
        print(f"{v:>8} {s.sessions:>9} {s.passed:>9} {s.acceptance:>6.1%} {figure:>9}")
    versions = [v for v in served if v in by]
    gain = (by[versions[-1]].acceptance - by[versions[0]].acceptance) * 100 if versions else 0.0
    held = [v for v in served if v in held_out]
    held_gain = (held_out[held[-1]] - held_out[held[0]]) * 100 if held else 0.0
    for canary in canaries:
        print(f"canary v{canary['version']} {canary['status']} "
              f"({canary['decided_by'] or '-'}): {canary['reason']}")
    plot = plot_demo(population.outcomes, held_out, settings.data_dir / "demo.png")
    write_sessions(population.outcomes, settings.data_dir / "live" / "sessions.jsonl")
    print(f"sessions {stats.sessions} ({stats.turns} completions; {stats.spanning_swap} spanned "
          f"a hot-swap or a canary's end), feedback sent {stats.feedback_sent}, refused "
          f"releases {sum(r['status'] == 'rejected' for r in releases)}, canaries rolled "
          f"back {sum(r['status'] == 'rolled_back' for r in releases)}; plot {plot}")
    for failure in stats.failures:
        print(f"failed request: {failure}")
    print(json.dumps({
        "acceptance_by_version": {str(v): round(s.acceptance, 4) for v, s in by.items()},
        "acceptance_gain_points": round(gain, 1),
        "held_out_by_version": {str(v): round(p, 4) for v, p in held_out.items()},
        "held_out_gain_points": round(held_gain, 1),
        "releases": len(served) - 1,  # published (promoted), whatever they served
        "failed_requests": stats.failed_requests,
        "cheating_flagged": stats.cheating_flagged,
        "monitor_breaches": breaches,
        "canary_decisions": [canary_decision(c) for c in canaries],
        "wall_s": round(wall_s, 1)}))
    return 0


def write_sessions(outcomes: list[Any], path: Path) -> Path:
    """Every developer session, one JSON object a line (`SessionOutcome`'s fields: the task,
    the version of each model turn, the true verdict and the feedback sent), for looking into
    what the figures sum up, e.g. acceptance per task family and version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for outcome in outcomes:
            out.write(json.dumps(dataclasses.asdict(outcome)) + "\n")
    return path


def plot_demo(outcomes: list[Any], held_out: dict[int, float], path: Path, *,
              window: int = 150) -> Path | None:
    """Live acceptance per served version over time (a rolling mean of `window` sessions,
    dashed: the version's whole mean) and held-out pass@1 per version."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not outcomes:
        return None
    t0 = outcomes[0].finished_at
    fig, (live, gate) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=(2, 1))
    for version in sorted({o.version for o in outcomes if o.version is not None}):
        mine = [o for o in outcomes if o.version == version]
        passed = [float(o.passed) for o in mine]
        times = [o.finished_at - t0 for o in mine]
        start = min(30, len(mine) - 1)  # a rolling mean of a handful is noise
        spans = [passed[max(0, i - window + 1):i + 1] for i in range(start, len(mine))]
        rolling = [sum(span) / len(span) for span in spans]
        line, = live.plot(times[start:], rolling, label=f"v{version} ({len(mine)} sessions)")
        live.hlines(sum(passed) / len(passed), times[0], times[-1], colors=line.get_color(),
                    linestyles="dashed")
    live.set(xlabel="live loop time (s)",
             ylabel=f"sessions whose tests pass (rolling {window})", ylim=(0, 1),
             title="Live acceptance of simulated developers, per served version")
    live.legend(loc="upper left")
    versions = sorted(held_out)
    bars = gate.bar([f"v{v}" for v in versions], [held_out[v] for v in versions])
    gate.bar_label(bars, labels=[f"{held_out[v]:.0%}" for v in versions])
    gate.set(ylim=(0, 1), ylabel="held-out pass@1 (the gate's: 8 samples at 0.7)",
             title="Eval gate, per version")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
