"""The online trainer's loop: poll `experiences`, batch, step, checkpoint, commit, release.

The batches come from trainer/online/intake.py. `OnlineLoop` applies control commands
(pause, resume, release), steps the trainer, checkpoints, commits Kafka offsets once the
checkpoint is durable, and hands weights to the release pipeline every `release_every_steps`
trainer steps, or every `release_interval_s`, and waits for the build, or, with
`release_in_background`, trains on from them while the pipeline builds and gates them on a
thread (trainer/online/handoff.py); the next release waits for the build.

A release that goes to a canary (trainer/release/canary_stage.py) serves its share of sessions
from the moment it is announced, and the trainer trains on from its weights meanwhile: what
was generated before counts as stale, and, under `max_staleness` 0, so does what its parent
serves beside it. The next release waits for the decision (it is built on a decided
version). Promoted: it serves every session. Rolled back: the trainer returns to the served
release, as after a refusal, and the canary's own sessions are stale from then on.

The weights handed over become the KL anchor at once, stashed under their sha256: the trainer
trains on from them, so its trust region is around them (anchored to the parent, a long
canary or build pulls the trainer back toward the parent). A refusal or a rollback returns
both the policy and the anchor to the served release's weights. The process around the loop
is trainer/online/process.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ingest.deletions import Forgotten
from ingest.log import Delivered
from trainer.online.config import MAX_STALENESS
from trainer.online.control import TrainerControl
from trainer.online.handoff import Handoff
from trainer.online.intake import Batch, ExperienceSource, stale_before, take_batch
from trainer.online.monitor_watch import MonitorWatch
from trainer.online.trainer import OnlineTrainer
from trainer.release.monitors import Breach
from trainer.release.pipeline import ReleaseOutcome, ReleaseSink
from trainer.trackers import Trackers

log = logging.getLogger(__name__)


# ---- the loop -----------------------------------------------------------------------------
@dataclass
class OnlineReport:
    steps: int
    consumed: int
    skipped: int
    releases: list[dict[str, Any]]
    forgotten: int = 0
    stale: int = 0


def _write_json(path: Path, value: Any) -> None:
    import json

    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


class OnlineLoop:
    """Poll -> batch -> step -> checkpoint -> commit; control commands; release cadence."""

    def __init__(self, trainer: OnlineTrainer, source: ExperienceSource, *,
                 candidate_dir: Path, latest_candidate: Path | None = None,
                 release_sink: ReleaseSink | None = None,
                 control: TrainerControl | None = None,
                 on_step: Callable[[dict[str, float]], None] | None = None,
                 trackers: Trackers | None = None, forgotten: Forgotten | None = None,
                 watch: MonitorWatch | None = None) -> None:
        self.trainer, self.source, self.cfg = trainer, source, trainer.cfg
        self.trackers = trackers
        self.candidate_dir, self.latest_candidate = candidate_dir, latest_candidate
        self.release_sink, self.control, self.on_step = release_sink, control, on_step
        self.forgotten, self.watch = forgotten, watch
        self.pending: list[Delivered[Any]] = []
        self.paused = False
        self.held: list[Breach] = []  # monitors that tripped: no release until resumed
        self._next_watch = 0.0
        self.skipped = self.dropped = self.stale = 0
        self.releases: list[dict[str, Any]] = []
        self._canary_result: dict[str, Any] | None = None  # the entry of the release in its canary
        self.handoff: Handoff | None = None  # the candidate the pipeline is building
        self._next_control = self._next_canary = 0.0
        self._checkpointed_step = trainer.state.step
        source.seek(trainer.state.offsets)

    def run(self, stop: threading.Event | None = None) -> OnlineReport:
        stop = stop or threading.Event()
        while not stop.is_set() and not self._done():
            self._handle_control()
            self._watch_monitors()
            self.finish_release()
            if self.trainer.state.canary is not None:
                self._follow_canary()
            self._release_if_due()
            if self.paused or (self._waiting() and self._release_due()):  # the next waits
                stop.wait(self.cfg.control_every_s)
                continue
            self.pending.extend(self.source.poll(timeout_ms=self.cfg.poll_timeout_ms))
            if self.forgotten is not None and len(self.pending) >= self.cfg.min_batch:
                self.forgotten.refresh()  # a deletion holds from the next batch on
            batch = take_batch(self.pending, self.trainer.ledger, min_batch=self.cfg.min_batch,
                               max_batch=self.cfg.max_batch, forgotten=self.forgotten,
                               stale_cut=stale_before(self.trainer.state.published_at,
                                                      self.cfg.max_staleness),
                               stale_versions=self.trainer.state.stale_versions)
            if batch is not None:
                self._train(batch)
            else:
                self.trainer.tick()
            self._release_if_due()
        self.finish_release(wait=True)  # a build under way is seen through
        if self.trainer.state.step > self._checkpointed_step:  # a clean stop loses nothing
            self._checkpoint()
        self._publish_status()
        return OnlineReport(self.trainer.state.step, self.trainer.ledger.trained, self.skipped,
                            self.releases, self.dropped, self.stale)

    def _release_if_due(self) -> None:
        if not (self._waiting() or self._released_enough()) and self._release_due():
            self.release(requested_by="trainer", reason="release_interval")

    def _waiting(self) -> bool:
        """A candidate is being built, or is in its canary: the next release waits."""
        return self.handoff is not None or self.trainer.state.canary is not None

    def _release_due(self) -> bool:
        """Every `release_every_steps` trainer steps where set: each release holds the same
        training on any machine; else every `release_interval_s` of wall time."""
        state = self.trainer.state
        if self.cfg.release_every_steps is not None:
            return state.step - state.last_release_step >= self.cfg.release_every_steps
        return time.time() - state.last_release_wall >= self.cfg.release_interval_s

    def _done(self) -> bool:
        return (self.cfg.stop_after is not None
                and self.trainer.ledger.trained >= self.cfg.stop_after) or self._released_enough()

    def _released_enough(self) -> bool:
        published = sum(bool(r["released"]) for r in self.releases)
        return (self.cfg.stop_after_releases is not None
                and published >= self.cfg.stop_after_releases)

    def _train(self, batch: Batch) -> None:
        self.skipped += batch.skipped
        self.dropped += batch.forgotten
        self.stale += batch.stale
        if batch.forgotten:
            log.info("passed over %d experiences of deleted users", batch.forgotten)
        if batch.stale:
            log.info("passed over %d experiences staler than %d releases", batch.stale,
                     self.cfg.max_staleness)
        metrics = self.trainer.step(batch.experiences)
        if self.watch is not None:
            self.watch.note_step(metrics)
            self.watch.note_experiences(batch.experiences)
        self.trainer.state.offsets.update(batch.offsets)
        if self.trainer.state.step % self.cfg.checkpoint_every_steps == 0 or self._done():
            self._checkpoint()
        log.info("step %d %s", self.trainer.state.step, metrics)
        if self.trackers is not None:
            self.trackers.report(self.trainer.state.step, metrics)
        if self.on_step is not None:
            self.on_step(metrics)
        self._publish_status()

    def _checkpoint(self) -> None:
        self.trainer.checkpoint()
        self._checkpointed_step = self.trainer.state.step
        self.source.commit_offsets(self.trainer.state.offsets)  # only once durable
        if self.latest_candidate is not None:  # what POST /admin/releases builds from
            self.trainer.export_candidate(self.latest_candidate)
            _write_json(self.latest_candidate.with_name(
                self.latest_candidate.name + ".provenance.json"), self.provenance())

    def provenance(self) -> dict[str, Any]:
        """Steps not released yet, and the generation and feedback event ids they trained on."""
        state = self.trainer.state
        entries = self.trainer.ledger.between(state.release_from_step, state.step - 1)
        return {"step_range": [state.release_from_step, state.step - 1],
                "generation_ids": [g for e in entries for g in e.generation_ids],
                "feedback_event_ids": [f for e in entries for f in e.feedback_event_ids]}

    def release(self, *, requested_by: str, reason: str,
                command_id: int | None = None) -> dict[str, Any] | None:
        """Hand the current weights to the release pipeline with their provenance (none while
        a monitor's breach holds the trainer, or another release is under way). Returns what
        became of them, or None while the pipeline builds them in the background (the loop
        then settles them, and answers `command_id`, when the build ends)."""
        state = self.trainer.state
        if self.held:
            return {"released": False, "reason": "held by the monitors until the trainer is "
                    "resumed: " + "; ".join(b.describe() for b in self.held)}
        if state.canary is not None:
            return {"released": False, "reason": f"v{state.canary['version']} is in its canary"}
        if self.handoff is not None:
            return {"released": False,
                    "reason": f"steps {self.handoff.step_range} are being built"}
        state.last_release_wall, state.last_release_step = time.time(), state.step
        if self.release_sink is None or state.step <= state.release_from_step:
            return {"released": False, "reason": "no sink" if self.release_sink is None
                    else "no new steps since the last release"}
        provenance = self.provenance()
        path = self.trainer.export_candidate(self.candidate_dir / f"step-{state.step}.safetensors")
        sha256 = self.trainer.stash()
        self.trainer.adopt_stashed(sha256)  # the KL anchor: the weights trained on from
        self.handoff = Handoff(provenance["step_range"], sha256,
                               command_id).start(self.release_sink, path, provenance,
                                                 requested_by=requested_by, reason=reason)
        if not self.cfg.release_in_background:
            return self.finish_release(wait=True)
        return None

    def finish_release(self, *, wait: bool = False) -> dict[str, Any] | None:
        """Once the pipeline has built the candidate handed over (at once with `wait`): follow
        what became of it, record it, and answer the command that asked for it."""
        handoff = self.handoff
        if handoff is None or not (wait or handoff.done()):
            return None
        handoff.wait()
        self.handoff = None
        result = handoff.result()
        self.releases.append(result)
        outcome = handoff.outcome  # None: the build failed, which judged nothing: its steps
        if outcome is not None and outcome.published:  # go into the next candidate, which
            self.trainer.state.release_from_step = handoff.step_range[1] + 1  # else starts here
        if outcome is None:  # anchored to what serves again
            self.trainer.adopt_stashed(self.trainer.state.served_sha256 or "")
        elif outcome.canary:
            self._begin_canary(result, outcome, handoff.sha256)
        else:
            self._settle(result, outcome, handoff.sha256)
        if self.control is not None and handoff.command_id is not None:
            self.control.done(handoff.command_id, result)
        self._publish_status()
        return result

    def _settle(self, result: dict[str, Any], outcome: ReleaseOutcome, sha256: str) -> None:
        """The trainer after a release's fate: served (the staleness bound follows it), or
        not (train on from what is served, not from the refused weights: the steps since they
        were handed over are dropped with them)."""
        if result["released"]:
            self.trainer.state.served_sha256 = sha256
            self._mark_published()
            self._served(outcome.version, outcome.parent, outcome.eval_summary, result)
        else:
            self._back_to_served()
        self._checkpoint()

    def _back_to_served(self) -> None:
        """The steps since the served release are in no weights now: train on from the served
        weights, and count the cadence from here."""
        state = self.trainer.state
        self.trainer.revert_to_served(state.served_sha256 or "")
        state.release_from_step = state.last_release_step = state.step
        state.last_release_wall = time.time()

    def _served(self, version: int, parent: int | None, eval_summary: dict[str, float],
                result: dict[str, Any]) -> None:
        if self.watch is not None:
            self.watch.note_release(version, parent, eval_summary)
        self.trainer.state.last_release = {**result, "at": time.time()}

    def _mark_published(self) -> None:
        """A release serves from now on: the staleness bound's newest."""
        state, kept = self.trainer.state, MAX_STALENESS + 1
        state.published_at = [*state.published_at, time.time()][-kept:]

    def _begin_canary(self, result: dict[str, Any], outcome: ReleaseOutcome,
                      sha256: str) -> None:
        state = self.trainer.state
        result["canary"] = "running"
        self._canary_result = result
        state.canary = {"version": outcome.version, "parent": outcome.parent,
                        "sha256": sha256, "eval_summary": outcome.eval_summary}
        self._mark_published()
        if self.cfg.max_staleness == 0 and outcome.parent is not None:
            state.stale_versions = [outcome.parent]  # its arm is a release behind
        self._checkpoint()

    def _follow_canary(self) -> None:
        """Every `control_every_s`: once the canary has ended, follow its decision."""
        state = self.trainer.state
        canary = state.canary
        assert canary is not None and self.release_sink is not None
        if time.monotonic() < self._next_canary:
            return
        self._next_canary = time.monotonic() + self.cfg.control_every_s
        status = self.release_sink.status(canary["version"])
        if status == "canary":
            return
        result = self._canary_result
        if result is None:  # begun before a restart
            result = {"version": canary["version"], "sha256": canary["sha256"]}
            self.releases.append(result)
        promoted = status == "published"
        result.update(released=promoted, canary="promoted" if promoted else "rolled_back")
        if promoted:
            state.served_sha256 = canary["sha256"]
            self._served(canary["version"], canary["parent"], canary["eval_summary"], result)
        else:  # the served release again: the steps since the canary began are dropped
            self._back_to_served()
            state.stale_versions = [canary["version"]]
        log.info("canary v%d %s", canary["version"], result["canary"])
        state.canary, self._canary_result = None, None
        self._checkpoint()
        self._publish_status()

    def _handle_control(self) -> None:
        if self.control is None or time.monotonic() < self._next_control:
            return
        self._next_control = time.monotonic() + self.cfg.control_every_s
        building = self.handoff.command_id if self.handoff is not None else None
        for command in self.control.pending():
            result: dict[str, Any] | None
            if command.id == building:  # answered when its build ends
                continue
            if command.kind == "pause":
                self.paused, result = True, {"paused": True}
            elif command.kind == "resume":  # acknowledges what the monitors found
                self.paused, self.held, result = False, [], {"paused": False}
            elif command.kind == "release":
                result = self.release(requested_by=command.requested_by, reason=command.reason,
                                      command_id=command.id)
            else:
                result = {"error": f"unknown command {command.kind!r}"}
            if result is not None:
                self.control.done(command.id, result)
        self._publish_status()

    def _watch_monitors(self) -> None:
        """Record what the monitors found; a breach pauses the trainer and holds its releases
        until resumed (`monitors.on_breach` "pause")."""
        if self.watch is None or time.monotonic() < self._next_watch:
            return
        self._next_watch = time.monotonic() + self.cfg.control_every_s
        if not (breaches := self.watch.new_breaches()):
            return
        log.warning("monitors tripped: %s", "; ".join(b.describe() for b in breaches))
        if self.cfg.monitors.on_breach == "pause":
            self.paused, self.held = True, [*self.held, *breaches]
        if self.control is not None:
            self.control.record_breaches(breaches)
        if self.trackers is not None:
            self.trackers.report(self.trainer.state.step, {"monitor_breaches": len(breaches)})
        self._publish_status()

    def _publish_status(self) -> None:
        if self.control is None:
            return
        state = self.trainer.state
        last = state.last_release or {}
        self.control.publish(step=state.step, consumed=self.trainer.ledger.trained,
                             lag=self.source.lag(state.offsets), paused=self.paused,
                             last_release_version=last.get("version"),
                             last_release_step=(last.get("step_range") or [None, None])[1],
                             metrics=self.trainer.last_metrics)
