"""`flywheel demo --loop`: the whole flywheel on one machine, measured on live traffic.

Starts the stack (broker, API with the torch engine and its release follower), the join
(sessions x feedback -> experiences), the online trainer (with the release pipeline of
trainer/release.py as its sink) and a simulated user population with a hidden taste
(simulate/users.py). Every `release_interval` the trainer hands its weights to the pipeline;
the replica hot-swaps each published release while users keep calling it. At the end: a table
and a PNG plot of the users' acceptance rate per served version, and one JSON line
{"acceptance_by_version": {...}, "acceptance_gain_points": ..., "releases": ...,
"failed_requests": ...}.

The model is the base model (`flywheel init-model`); bootstrap (#6) would start from its
output instead (`FLYWHEEL_MODEL_DIR`).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from app.settings import Settings
from app.stack import running_stack

log = logging.getLogger(__name__)


def demo_settings(settings: Settings, *, loop_s: float, releases: int) -> Settings:
    """The demo's knobs: a release every loop_s / (releases + 1), a fast-learning trainer."""
    online = settings.online.model_copy(update={
        "min_batch": 16, "max_batch": 32, "lr": 1e-2, "kl_coef": 0.01, "threads": 1,
        "release_interval_s": loop_s / (releases + 1), "checkpoint_every_steps": 4})
    # The held-out gate guards a real model's language ability. The demo's base model has
    # random weights (held-out loss ~ log vocab = 7.6 nats: no ability to guard), and learning
    # the users' taste concentrates its mass, which raises that loss by 1-3 nats; so the demo
    # gate only refuses a candidate whose held-out loss explodes.
    gate = settings.release.eval.model_copy(update={"max_regression": 5.0})
    release = settings.release.model_copy(update={"eval": gate})
    engine = settings.engine.model_copy(update={"threads": 1})
    update: dict[str, Any] = {"online": online, "release": release, "engine": engine}
    if not settings.feedback_secrets:
        update["feedback_secrets"] = [SecretStr(secrets.token_hex(16))]
    return settings.model_copy(update=update)


def _version_number(fingerprint: str) -> int:
    return int(fingerprint.split("-")[1].lstrip("v"))  # "fw-v3-<sha12>"


def run_demo_loop(settings: Settings, *, loop_s: float = 360.0, releases: int = 4,
                  concurrency: int = 6, min_per_version: int = 200) -> int:
    from app.releases import PipelineReleaseSink
    from ingest.join import run_join
    from simulate.users import UserPopulation, aligned_prefix_preference
    from trainer.init_model import init_model
    from trainer.online import run_online
    from trainer.online_control import SqlTrainerControl, open_control_db

    settings = demo_settings(settings, loop_s=loop_s, releases=releases)
    if settings.model_dir is None:
        init_model(settings.model, settings.resolved_model_dir)
    preference = aligned_prefix_preference(settings.resolved_model_dir)
    with running_stack(settings) as stack:
        s = stack.settings
        stop = threading.Event()
        reports: dict[str, Any] = {}
        join = threading.Thread(target=lambda: reports.update(join=run_join(
            stack.kafka, s.join, database_url=s.resolved_join_database_url, stop=stop)),
            name="join", daemon=True)
        control = SqlTrainerControl(open_control_db(s.resolved_database_url))
        trainer = threading.Thread(target=lambda: reports.update(trainer=run_online(
            s, release_sink=PipelineReleaseSink(s), control=control, stop=stop)),
            name="trainer", daemon=True)
        join.start()
        trainer.start()
        users = UserPopulation(stack.base_url, preference=preference,
                               secret=s.feedback_secrets[0].get_secret_value())
        started = time.monotonic()
        print(f"demo loop: stack at {stack.base_url}, {len(preference.prefixes)} hidden "
              f"preferred prefixes, a release every {s.online.release_interval_s:.0f}s",
              flush=True)
        try:
            while time.monotonic() - started < loop_s:
                users.run(requests=concurrency * 4, concurrency=concurrency)
                by = users.stats.by_version
                newest = max(by, key=_version_number) if by else None
                print(f"  t={time.monotonic() - started:5.0f}s "
                      + " ".join(f"v{_version_number(v)}:{st.rate:.2f}/{st.served}"
                                 for v, st in sorted(by.items(),
                                                     key=lambda kv: _version_number(kv[0]))),
                      flush=True)
                if (newest is not None and _version_number(newest) >= releases
                        and by[newest].served >= min_per_version):
                    break
        finally:
            loop_time = time.monotonic() - started
            stop.set()
            trainer.join(timeout=120)
            join.join(timeout=30)
            users.close()
    return _report(settings, users, reports, loop_time)


def _report(settings: Settings, users: Any, reports: dict[str, Any], loop_time: float) -> int:
    by = {_version_number(v): st for v, st in users.stats.by_version.items()}
    versions = sorted(by)
    print(f"\n{'version':>8} {'served':>7} {'accepted':>9} {'rate':>6}")
    for v in versions:
        print(f"{v:>8} {by[v].served:>7} {by[v].accepted:>9} {by[v].rate:>6.2f}")
    trainer = reports.get("trainer")
    published = [r for r in (trainer.releases if trainer else []) if r.get("released")]
    plot = _plot(users.log, settings.data_dir / "demo_acceptance.png")
    gain = (by[versions[-1]].rate - by[versions[0]].rate) * 100 if versions else 0.0
    print(f"loop time {loop_time:.0f}s; trainer steps {trainer.steps if trainer else 0}, "
          f"experiences {trainer.consumed if trainer else 0}, releases published "
          f"{len(published)} (hot-swapped while users were served: {len(versions) - 1}); "
          f"plot {plot}")
    print(json.dumps({"acceptance_by_version": {str(v): round(by[v].rate, 4) for v in versions},
                      "acceptance_gain_points": round(gain, 1),
                      "releases": max(0, len(versions) - 1),
                      "failed_requests": users.stats.failed_requests}))
    return 0


def _plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Acceptance rate per served version over time (a rolling mean of 40 completions)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not rows:
        return None
    t0 = rows[0]["t"]
    fig, ax = plt.subplots(figsize=(8, 4))
    for version in sorted({r["version"] for r in rows}, key=_version_number):
        mine = [r for r in rows if r["version"] == version]
        xs, ys = [], []
        for i in range(len(mine)):
            window = mine[max(0, i - 39):i + 1]
            xs.append(mine[i]["t"] - t0)
            ys.append(sum(bool(r["accepted"]) for r in window) / len(window))
        ax.plot(xs, ys, label=f"v{_version_number(version)} ({len(mine)} served)")
    ax.set_xlabel("loop time (s)")
    ax.set_ylabel("acceptance rate (rolling 40)")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("Live acceptance of simulated users per served model version")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
