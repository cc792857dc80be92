"""`flywheel demo`: the whole flywheel on one machine, on the real task, measured live.

1. Build the base model (`flywheel init-model`) and bootstrap it: mid-training, then a short
   GRPO run (trainer/bootstrap/run.py). A bootstrapped model already under the data dir is reused
   (the demo says so).
2. Serve it as version 0: the stack (broker, API with the torch engine and its release
   follower), the join (sessions x feedback -> experiences), the online trainer with the
   release pipeline as its sink (eval gate: held-out pass@1, then a canary: half the sessions
   on the candidate until the users' verdicts promote it or roll it back; one they leave
   undecided is held at its cap, and the demo, as its admin, rolls it back).
3. Simulated developers (simulate/developers.py) work on the product split of the tasks
   through the public HTTP API, one chat completion per agent turn, and send a signed verdict
   per session. The trainer learns from the joined verdicts and hands its weights to the
   release pipeline every `release_every_steps` trainer steps; the replica hot-swaps each
   release while the developers keep working.
4. When `releases` releases are live and the newest one has served `min_sessions` sessions:
   a table, a PNG (live acceptance per version, held-out pass@1 per release) and one JSON line
   {"acceptance_by_version": {...}, "acceptance_gain_points": ..., "held_out_by_version":
   {...}, "held_out_gain_points": ..., "releases": ..., "failed_requests": ...,
   "cheating_flagged": ..., "monitor_breaches": ..., "canary_decisions": [...], "wall_s": ...}.
"""

from __future__ import annotations

import json
import secrets
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from pydantic import SecretStr

from app.cli.demo_report import release_line, report
from app.cli.stack import running_stack
from app.settings import Settings
from serving.config import DEFAULT_PREFIX_CACHE_TOKENS
from simulate.task_templates import DIGIT_FAMILIES, LETTER_FAMILIES
from trainer.bootstrap.config import LETTER_WEIGHT

if TYPE_CHECKING:  # the developers' process pulls in the openai client: the demo's alone
    from app.cli.demo_developers import DeveloperProcess

# The demo's version 0: mid-trained until the first calls of unseen practice tasks are written
# with probability 0.15 at 0.7, the letter templates' demonstrations drawn four times as often
# as the others' (`LETTER_WEIGHT`, as `flywheel bootstrap` does; docs/bootstrap.md): a start
# that copies integers and letters alike, so that every template of the developers' traffic
# can learn from their verdicts (at the old start, 0.3 and unweighted, the letters, 28% of
# it, never did; docs/demo.md has both starts' runs).
# The single-digit practice templates drawn eight times as often: without them version 0 wrote
# `x + 30` for `add_3` and passed 14 of the 18 held-out single-digit tasks (a third of the
# held-out set, and of the traffic) in none of 16 samples, leaving the verdicts nothing to reward
MIDTRAIN_UNTIL = 0.15
DIGIT_WEIGHT = 8.0


def family_weights(letter: float = LETTER_WEIGHT, digit: float = DIGIT_WEIGHT) -> dict[str, float]:
    """Mid-training's draw weights: the letter templates' and the digit practice templates'."""
    return dict.fromkeys(LETTER_FAMILIES, letter) | dict.fromkeys(DIGIT_FAMILIES, digit)


@dataclass(frozen=True)
class DemoPlan:
    """The demo's budget (`flywheel demo --help` sets each): a quality for version 0 and counts
    of work after it, so every run starts from a model of the same strength and makes the same
    training on any machine; only the wall time differs."""

    # a short bootstrap: the model a product would first ship, with room to learn. Mid-training
    # stops once the model writes the first call of unseen practice tasks with probability
    # `midtrain_until` at 0.7 (a quality: where the copying of a parameter forms moves with the
    # CPU's float order), within `midtrain_steps`; None or 0: exactly `midtrain_steps`
    midtrain_steps: int = 1000
    midtrain_until: float | None = MIDTRAIN_UNTIL
    grpo_steps: int = 10
    releases: int = 5  # held-out and live still rose at the fourth (docs/demo.md)
    release_every_steps: int = 24  # online trainer steps of `online_batch` experiences
    online_batch: int = 64
    min_sessions: int = 500  # served by the newest release before the demo ends (±2 points)
    # a safety stop for the live loop, far beyond a normal run: on a VM at half the usual
    # speed the live loop with the canary reached 1,800 s at its fifth canary (docs/demo.md)
    max_loop_s: float = 3600.0
    concurrency: int = 10  # simulated developers at once
    temperature: float = 0.7  # the developers' agent samples at an editor's temperature
    # each release that passes the gate serves this share of sessions until the canary's
    # test decides (0: no canary): at one half a candidate 5 points better is promoted after
    # a median 254 sessions of both arms (a simulation of `CanaryTest` at the defaults)
    canary_share: float = 0.5
    # a canary undecided after this many candidate sessions is held (the product's default:
    # 4000), and the demo, as its operator, rolls the candidate back: not shown no worse. Near
    # the test's point of indifference (worse by half the margin) it can wander for thousands
    # of sessions: one candidate 6 points worse sat undecided for 2,900 on a slow VM, the demo
    # waiting on it (docs/demo.md); decided canaries took at most 900 candidate sessions so far
    canary_max_sessions: int = 1500


def demo_settings(settings: Settings, plan: DemoPlan) -> Settings:
    """The demo's knobs on top of `settings`: the trainer's cadence and batches, the engine's
    prefix cache (an agent's next turn extends its conversation) and a signing secret."""
    # the format anchor on the bootstrap's own demonstrations holds the call syntax, which
    # lets the rate double (at 4e-4 without it a candidate broke the syntax in every run)
    anchor = settings.online.anchor.model_copy(update={"coef": 1.0,
                                                       "tasks": settings.bootstrap.tasks})
    # every experience is of the served release (max_staleness 0), so no trust region at the
    # behavior logprobs: under the PPO clip a release is one PPO iteration, each token's
    # probability moving at most 1 +- clip from the served one's, whatever the steps; truncated
    # IS lets the decisions the feedback is about move, and the KL to the served release at
    # 0.1 holds the rest (docs/demo.md: live +20.4 / held-out +16.2 against +3.9 / -2.8)
    # the monitors report in the demo, and do not pause it: its small model's turn after a
    # failed test shifts between releases (v1 botched 13% of its calls where v0 botched 7% in
    # one run) with no reward to gain from it; the demo measures learning, and shows what the
    # monitors saw (docs/demo.md)
    monitors = settings.online.monitors.model_copy(update={"on_breach": "report"})
    online = settings.online.model_copy(update={
        "monitors": monitors,
        "release_every_steps": plan.release_every_steps, "stop_after_releases": plan.releases,
        "threads": 1, "lr": 2e-4, "anchor": anchor, "max_staleness": 0,
        "objective": "truncated_is", "kl_coef": 0.1,
        "min_batch": plan.online_batch,
        "max_batch": plan.online_batch, "checkpoint_every_steps": 10})
    engine = settings.engine.model_copy(update={
        "threads": 1, "prefix_cache_tokens": DEFAULT_PREFIX_CACHE_TOKENS})
    # a canary rolled back although as good as its parent costs the demo a release and its
    # training: at beta 0.05 per metric, 2 of 23 canaries in four runs (26% against 52% on an
    # equal candidate's first 65 sessions); at 0.01 a worse one takes longer to go
    canary = settings.release.canary.model_copy(update={
        "enabled": plan.canary_share > 0, "share": plan.canary_share or 0.5, "beta": 0.01,
        "max_sessions": plan.canary_max_sessions})
    release = settings.release.model_copy(update={"canary": canary})
    bootstrap = settings.bootstrap.model_copy(update={
        "midtrain_steps": plan.midtrain_steps, "midtrain_until": plan.midtrain_until or None,
        "midtrain_family_weights": family_weights(),
        "midtrain_check_every": 10,  # the score goes from 10% to 35% in about 50 steps
        "max_steps": plan.grpo_steps,
        # validation scored before and after GRPO: the better becomes version 0
        "time_budget_s": None, "eval_every": plan.grpo_steps})
    update: dict[str, Any] = {"online": online, "engine": engine, "bootstrap": bootstrap,
                              "release": release}
    if not settings.feedback_secrets:
        update["feedback_secrets"] = [SecretStr(secrets.token_hex(16))]
    return settings.model_copy(update=update)


def bootstrapped_model(settings: Settings) -> tuple[Path, dict[str, Any] | None]:
    """The bootstrap's final model under the data dir, built unless it is there already;
    returns it and the bootstrap's summary (None when reused)."""
    from trainer.bootstrap.run import run_bootstrap
    from trainer.init_model import init_model

    run_dir = settings.data_dir / "bootstrap"
    model = run_dir / "model"
    if (model / "config.json").exists():
        print(f"reusing the bootstrapped model in {model} (delete it to bootstrap again)",
              flush=True)
        return model, None
    base = init_model(settings.model, settings.resolved_model_dir)
    cfg = settings.bootstrap
    until = "" if cfg.midtrain_until is None else (
        f" (fewer once unseen tasks' first calls are written with probability "
        f"{cfg.midtrain_until:.0%} at {cfg.midtrain_check_temperature})")
    print(f"bootstrap: {cfg.midtrain_steps} mid-training steps{until}, then {cfg.max_steps} "
          f"GRPO steps", flush=True)
    summary = run_bootstrap(cfg, base, run_dir, batch_invariant=settings.batch_invariant)
    details = json.loads((run_dir / "summary.json").read_text())
    print(f"bootstrap: {details['midtrain_steps']} mid-training steps; held-out pass@1 "
          f"{summary['pass_at_1_before']:.1%} after them, {summary['pass_at_1_after']:.1%} "
          f"after GRPO", flush=True)
    return model, summary


def fresh_live_dir(data_dir: Path) -> Path:
    """`D/live`, emptied: every run's live loop starts from version 0 of the bootstrapped model,
    with no release, checkpoint, session or ledger of an earlier run."""
    live = data_dir / "live"
    if live.exists():
        print(f"removing the previous run's live state in {live}", flush=True)
        shutil.rmtree(live)
    live.mkdir(parents=True)
    return live


def run_demo_loop(settings: Settings, plan: DemoPlan | None = None) -> int:
    from app.cli.demo_developers import DeveloperProcess
    from app.cli.processes import join_process, train_online_rank

    started = time.monotonic()
    plan = plan or DemoPlan()
    settings = demo_settings(settings, plan)
    model_dir, _ = bootstrapped_model(settings)
    live = fresh_live_dir(settings.data_dir)
    with running_stack(settings.model_copy(
            update={"model_dir": model_dir, "data_dir": live})) as stack:
        s = stack.settings
        print(f"live: {stack.base_url} serves v0; {plan.concurrency} simulated developers on "
              f"the product tasks; a release every {plan.release_every_steps} trainer steps",
              flush=True)
        watch = LiveView(stack.base_url, s.admin_secret().get_secret_value(), plan)
        # the join, the trainer and the developers each in a process of their own, as in
        # production: the API's engine shares its interpreter's lock with the HTTP server alone
        with ServiceProcess("join", join_process, s.model_dump_json()) as join, \
                ServiceProcess("online trainer", train_online_rank, s.model_dump_json(),
                               True) as trainer, \
                DeveloperProcess(s, stack.base_url, concurrency=plan.concurrency,
                                 temperature=plan.temperature) as developers:
            watch.follow(developers, (join, trainer))
        releases, breaches, canaries = watch.releases(), watch.breaches(), watch.canaries()
    return report(settings, developers.population, releases, len(breaches), canaries,
                  time.monotonic() - started)


class ServiceProcess:
    """A service of the live loop in a spawned process, as it runs in production: the join
    (`flywheel join`; stopped by SIGTERM at the end, after the developers' last verdicts)
    or the online trainer with the release pipeline as its sink (`flywheel train-online`,
    which stops by itself once `releases` releases were published)."""

    def __init__(self, name: str, target: Callable[..., int], *args: object) -> None:
        import multiprocessing

        self.name = name
        self.process = multiprocessing.get_context("spawn").Process(
            target=target, args=args, name=name, daemon=True)

    def __enter__(self) -> ServiceProcess:
        self.process.start()
        return self

    def check(self) -> None:
        """Raise if the service died (a clean exit is the trainer's stop after its last
        release)."""
        if self.process.exitcode not in (None, 0):
            raise RuntimeError(f"the {self.name} exited with {self.process.exitcode} "
                               f"(its log is above)")

    def __exit__(self, *exc: object) -> None:
        if self.process.is_alive():
            self.process.terminate()  # SIGTERM: it checkpoints and stops after its step
        self.process.join(timeout=120)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class LiveView:
    """The progress display of the live loop, from the product's own admin API."""

    def __init__(self, base_url: str, admin_token: str, plan: DemoPlan) -> None:
        self.http = httpx.Client(base_url=base_url, timeout=30,
                                 headers={"Authorization": f"Bearer {admin_token}"})
        self.plan = plan

    def releases(self) -> list[dict[str, Any]]:
        reply = self.http.get("/admin/releases", params={"limit": 1000})
        reply.raise_for_status()
        return sorted(reply.json(), key=lambda r: r["version"])

    def canaries(self) -> list[dict[str, Any]]:
        """Every canary with its figures and decision, oldest first."""
        reply = self.http.get("/admin/releases/canaries", params={"limit": 100})
        reply.raise_for_status()
        return sorted(reply.json(), key=lambda c: c["version"])

    def end_held(self) -> list[str]:
        """Roll back every held canary, as the demo's operator (an admin decides a held
        canary; the demo takes the safe side); a line for each."""
        lines = []
        for canary in self.canaries():
            if canary["status"] != "held":
                continue
            sessions = (canary["figures"].get("acceptance") or {}).get("candidate_sessions")
            reply = self.http.post(f"/admin/releases/{canary['version']}/rollback", json={
                "requested_by": "demo", "reason": f"held undecided after {sessions} candidate "
                                                  f"sessions: rolled back by the demo"})
            if reply.status_code == 409:  # ended meanwhile
                continue
            reply.raise_for_status()
            lines.append(f"canary v{canary['version']} held after {sessions} candidate "
                         f"sessions: the demo rolls it back")
        return lines

    def breaches(self) -> list[dict[str, Any]]:
        """The reward-hacking monitors' breaches, newest first."""
        reply = self.http.get("/admin/trainer")
        reply.raise_for_status()
        return list((reply.json().get("trainer") or {}).get("breaches") or [])

    def follow(self, developers: DeveloperProcess, services: Sequence[ServiceProcess]) -> None:
        """Until `plan.releases` releases were served and the newest one has served
        `plan.min_sessions` sessions, or `plan.max_loop_s`."""
        from tqdm import tqdm

        stats = developers.population.stats
        started = time.monotonic()
        seen: set[tuple[int, str]] = set()
        shown: list[dict[str, Any]] = []
        bar = tqdm(total=self.plan.releases, desc="releases", unit="release", dynamic_ncols=True)
        try:
            while time.monotonic() - started < self.plan.max_loop_s:
                developers.poll()
                if developers.error is not None:
                    raise developers.error
                for service in services:
                    service.check()
                for b in self.breaches()[::-1][len(shown):]:  # oldest first
                    shown.append(b)
                    bar.write(f"monitor {b['monitor']} tripped on v{b['version']}: "
                              f"{b['value']:.3f} against {b['baseline']:.3f} (threshold "
                              f"{b['threshold']}), e.g. sessions {', '.join(b['sessions'][:3])}")
                served = self._served_version()
                rows = self.releases()
                if any(r["status"] == "canary" for r in rows):
                    for line in self.end_held():
                        bar.write(line)
                for row in rows:  # a line when a candidate is refused, put in its canary,
                    key = (row["version"], row["status"])  # promoted or rolled back
                    if row["version"] > 0 and key not in seen and row["status"] != "candidate":
                        seen.add(key)
                        bar.write(release_line(row))
                published = sum(r["version"] > 0 and r["status"] == "published" for r in rows)
                bar.n = min(published, self.plan.releases)
                # the newest release is the store's, and counts once the replica serves it:
                # just promoted, /admin/status still says its parent until the swap is in,
                # and the parent's sessions ended a run with the newest at 83 of 500
                newest_version = max((r["version"] for r in rows if r["status"] == "published"),
                                     default=0)
                newest = stats.by_version.get(newest_version) if served == newest_version \
                    else None
                bar.set_postfix_str(
                    f"v{served} | sessions {stats.sessions} | "
                    + " ".join(f"v{v}:{s.acceptance:.0%}" for v, s in
                               sorted(stats.by_version.items())), refresh=True)
                if published >= self.plan.releases and newest is not None \
                        and newest.sessions >= self.plan.min_sessions:
                    break
                time.sleep(2.0)
        finally:
            bar.close()

    def _served_version(self) -> int:
        reply = self.http.get("/admin/status")
        reply.raise_for_status()
        return int(reply.json()["model_version"])
