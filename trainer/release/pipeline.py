"""The release pipeline: candidate -> eval gate -> delta -> store -> announce (`build_release`).

A candidate checkpoint is gated against the served version; one that passes is stored as the
delta from it (and a full snapshot every `release.snapshot_every` releases, which resets the
chain), announced as `ReleasePublished` on `releases`, and its `release` row marked published.
A rejected candidate is recorded with the reason and never published. `rollback_release` takes
the head back to its parent by re-announcing the parent: replicas apply the same delta
backwards. The served version ("head") is the newest published release; version 0 is the base
model, recorded as a snapshot the first time the pipeline runs.

The weights work is trainer/release/weights.py's. app/ only wires the pipeline: the admin
routes, the Celery tasks (app/jobs/celery_app.py), the online trainer's `PipelineReleaseSink`.

    with open_release_context(settings.release_config()) as ctx:
        row = build_release(ctx, candidate=Path("data/checkpoints/latest"))
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, Protocol

from sqlalchemy import JSON, Column
from sqlalchemy import Engine as DbEngine
from sqlmodel import Field, Session, SQLModel, col, select

from ingest.events import ReleasePublished, utcnow
from ingest.log import EventProducer
from ingest.sql import open_database
from kernels.delta.manifest import VersionRef
from kernels.weights import state_dict_sha256
from trainer.release.config import ReleaseConfig
from trainer.release.weights import (
    ReleaseError,
    base_weights,
    evaluate,
    head_weights,
    load_candidate,
    save_weights,
    store_base,
    store_release,
)

log = logging.getLogger(__name__)

# "canary": passed the gate and announced to a share of sessions beside the head, until
# trainer/release/canary_stage.py promotes it ("published") or rolls it back
ReleaseStatus = Literal["candidate", "canary", "published", "rejected", "rolled_back"]


class ReleaseConflictError(ReleaseError):
    """The request contradicts the release history (e.g. rolling back a non-head version)."""


class Release(SQLModel, table=True):
    """One release candidate and what became of it: the pipeline's history.

    `manifest_uri` is the delta from `parent`; snapshots also have `snapshot_uri` and reset
    `chain_length` to 0. The online trainer fills the provenance columns: the step range and
    the generation and feedback event ids the weights were trained on.
    """

    version: int = Field(primary_key=True)
    parent: int | None = Field(default=None, index=True)
    kind: str = Field(max_length=16)  # delta | snapshot
    status: str = Field(default="candidate", max_length=16, index=True)  # a ReleaseStatus
    sha256: str = Field(max_length=64)
    manifest_uri: str | None = None
    snapshot_uri: str | None = None
    candidate_uri: str | None = None
    chain_length: int = 0
    requested_by: str = Field(default="system", max_length=128)
    reason: str = Field(default="", max_length=2000)
    eval_summary: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON))
    step_range: list[int] | None = Field(default=None, sa_column=Column(JSON))
    generation_ids: list[str] = Field(default_factory=list, sa_column=Column(JSON))
    feedback_event_ids: list[str] = Field(default_factory=list, sa_column=Column(JSON))
    created_at: datetime = Field(default_factory=utcnow)
    published_at: datetime | None = None
    rolled_back_at: datetime | None = None
    rolled_back_by: str | None = Field(default=None, max_length=128)
    rollback_reason: str | None = Field(default=None, max_length=2000)


@dataclass
class ReleaseContext:
    """What the pipeline touches: its config, the history (SQL), a producer on `releases`."""

    config: ReleaseConfig
    db: DbEngine
    producer: EventProducer


@contextmanager
def open_release_context(config: ReleaseConfig) -> Iterator[ReleaseContext]:
    """The history and a producer for one release or rollback, closed after it."""
    config.cache_dir.mkdir(parents=True, exist_ok=True)  # and the data dir: SQLite's home
    db = open_database(config.database_url, [Release.__table__])  # type: ignore[attr-defined]
    producer = EventProducer(config.kafka, client_id="flywheel-release")
    try:
        yield ReleaseContext(config, db, producer)
    finally:
        producer.close()
        db.dispose()


# ---- the pipeline ------------------------------------------------------------------------
def build_release(ctx: ReleaseContext, *, candidate: Path | None = None,
                  version: int | None = None, requested_by: str = "system",
                  reason: str = "", provenance: dict[str, Any] | None = None) -> Release:
    """Candidate -> eval gate -> delta -> store -> announce. Returns the candidate's row,
    published or rejected with the reason; a build that fails is recorded, then raised.
    `version` is a row `reserve_version` made (None: reserve one now)."""
    config, provenance = ctx.config, provenance or {}
    served = ensure_base(ctx)
    with Session(ctx.db) as session:
        running = canary_running(session)
    if running is not None:
        raise ReleaseConflictError(f"v{running.version} is in its canary: promote it or roll "
                                   "it back before the next release")
    path = candidate or config.candidate_path
    if version is None:
        version = reserve_version(ctx.db, requested_by=requested_by, reason=reason,
                                  candidate_uri=str(path))
    try:
        served_weights = head_weights(config, served.version, served.sha256)
        weights = load_candidate(path, config.model_dir)
        sha = state_dict_sha256(weights)
        decision = evaluate(config, served_weights, weights, served_sha256=served.sha256,
                            candidate_sha256=sha)
        if not decision.passed:
            return record(ctx.db, version, status="rejected", reason=decision.reason,
                          sha256=sha, eval_summary=decision.summary(), parent=served.version)
        chain = served.chain_length + 1
        snapshot = chain >= config.release.snapshot_every
        canary = config.release.canary
        stored = store_release(config, served_weights, weights,
                               base=VersionRef(version=served.version, sha256=served.sha256),
                               target=VersionRef(version=version, sha256=sha), snapshot=snapshot)
        row = publish(ctx, version, {
            "parent": served.version, "sha256": sha, "manifest_uri": stored.manifest_uri,
            "snapshot_uri": stored.snapshot_uri, "kind": "snapshot" if snapshot else "delta",
            "chain_length": 0 if snapshot else chain, "eval_summary": decision.summary(),
            "step_range": provenance.get("step_range"),
            "generation_ids": provenance.get("generation_ids", []),
            "feedback_event_ids": provenance.get("feedback_event_ids", [])},
            canary_share=canary.share if canary.enabled else None)
        if not canary.enabled:  # a canary's parent stays the head until it is promoted
            save_weights(weights, config.head_cache)
    except Exception as exc:
        record(ctx.db, version, status="rejected", reason=f"build failed: {exc}")
        raise
    log.info("%s v%d (parent v%d, %s)", row.status, version, served.version, decision.reason)
    return row


def ensure_base(ctx: ReleaseContext) -> Release:
    """The head, creating version 0 (the base model as a snapshot) on first use."""
    with Session(ctx.db) as session:
        current = head(session)
        if current is not None:
            return current
    weights = base_weights(ctx.config.model_dir)
    sha = state_dict_sha256(weights)
    stored = store_base(ctx.config, weights, sha)
    base = Release(version=0, kind="snapshot", status="published",
                   sha256=sha, snapshot_uri=stored.snapshot_uri, manifest_uri=stored.manifest_uri,
                   requested_by="system", reason="base model", published_at=utcnow())
    announce(ctx, announcement(base))
    with Session(ctx.db) as session:
        session.add(base)
        session.commit()
        session.refresh(base)
    return base


def publish(ctx: ReleaseContext, version: int, fields: dict[str, Any], *,
            canary_share: float | None = None) -> Release:
    """Fill the row of `version`, announce it, then mark it published (once Kafka has it);
    with `canary_share`, announce it to that share of sessions and mark it "canary"."""
    with Session(ctx.db) as session:
        row = session.get(Release, version)
        assert row is not None  # reserved before the build
        row.sqlmodel_update(fields)
        announce(ctx, announcement(row, canary_share=canary_share))
        row.status = "published" if canary_share is None else "canary"
        row.published_at = utcnow()
        session.add(row)
        session.commit()
        session.refresh(row)
        return row


def rollback_release(ctx: ReleaseContext, version: int, *, requested_by: str = "admin",
                     reason: str = "") -> Release:
    """Take the head `version` back to its parent; returns the parent (the new head)."""
    with Session(ctx.db) as session:
        row = session.get(Release, version)
        current = head(session)
        if row is None:
            raise ReleaseError(f"no release v{version}")
        running = canary_running(session)
        if running is not None:
            raise ReleaseConflictError(f"v{running.version} is in its canary against the "
                                       "head: end it first")
        if current is None or current.version != version:
            raise ReleaseConflictError(
                f"v{version} is {row.status}, not the served head "
                f"(v{current.version if current else '-'}); only the head can be rolled back")
        parent = session.get(Release, row.parent) if row.parent is not None else None
        if parent is None or parent.status != "published":
            raise ReleaseConflictError(f"v{version} has no published parent to return to")
        announce(ctx, ReleasePublished(version=parent.version, parent=version, kind="rollback",
                                       manifest_uri=row.manifest_uri or "",
                                       snapshot_uri=parent.snapshot_uri, sha256=parent.sha256,
                                       eval_summary={}))
        row.sqlmodel_update({"status": "rolled_back", "rolled_back_at": utcnow(),
                             "rolled_back_by": requested_by, "rollback_reason": reason})
        session.add(row)
        session.commit()
        session.refresh(parent)
        return parent


# ---- the announcement --------------------------------------------------------------------
def announcement(row: Release, *, canary_share: float | None = None) -> ReleasePublished:
    return ReleasePublished(
        version=row.version, parent=row.parent, kind=row.kind,  # type: ignore[arg-type]
        manifest_uri=row.manifest_uri or row.snapshot_uri or "", snapshot_uri=row.snapshot_uri,
        sha256=row.sha256, eval_summary={k: float(v) for k, v in row.eval_summary.items()
                                         if isinstance(v, int | float)},
        canary_share=canary_share)


def announce(ctx: ReleaseContext, event: ReleasePublished) -> None:
    """`event` on `releases`, keyed by its version; returns once Kafka acknowledged it."""
    kafka = ctx.config.kafka
    ctx.producer.send(kafka.topics.releases, str(event.version), event).get(
        timeout=kafka.delivery_timeout_ms / 1000)


# ---- the history -------------------------------------------------------------------------
def head(session: Session) -> Release | None:
    """The served version: the newest published release."""
    return session.exec(select(Release).where(Release.status == "published")
                        .order_by(col(Release.version).desc())).first()


def canary_running(session: Session) -> Release | None:
    """The release in its canary, if one is."""
    return session.exec(select(Release).where(Release.status == "canary")).first()


def reserve_version(db: DbEngine, *, requested_by: str, reason: str,
                    candidate_uri: str | None) -> int:
    """Record a candidate row now (so an API caller learns its version before the build)."""
    with Session(db) as session:
        newest = session.exec(select(Release).order_by(col(Release.version).desc())).first()
        version = 1 if newest is None else newest.version + 1  # 0 is the base model's
        session.add(Release(version=version, kind="delta", sha256="", status="candidate",
                            requested_by=requested_by, reason=reason,
                            candidate_uri=candidate_uri))
        session.commit()
        return version


def record(db: DbEngine, version: int, *, status: ReleaseStatus, reason: str,
           **fields: Any) -> Release:
    """Set the status of `version`, with the reason and any other columns."""
    with Session(db) as session:
        row = session.get(Release, version)
        if row is None:
            raise ReleaseError(f"no release v{version}")
        row.sqlmodel_update({"status": status, "reason": reason, **fields})
        session.add(row)
        session.commit()
        session.refresh(row)
        log.warning("v%d %s: %s", version, status, reason)
        return row


# ---- the online trainer's view -----------------------------------------------------------
@dataclass
class ReleaseOutcome:
    version: int
    published: bool
    sha256: str
    reason: str = ""
    parent: int | None = None  # the version it was measured against and deltas from
    eval_summary: dict[str, float] = field(default_factory=dict)  # the gate's figures
    canary: bool = False  # published to a canary share: `status` says what became of it


class ReleaseSink(Protocol):
    """Where the online trainer's loop (trainer/online/loop.py) hands its weights."""

    def release(self, candidate: Path, provenance: dict[str, Any], *,
                requested_by: str, reason: str) -> ReleaseOutcome: ...

    def status(self, version: int) -> str:
        """What became of `version` since (a `ReleaseStatus`): a canary's decision."""
        ...


class PipelineReleaseSink:
    """The `ReleaseSink` of `flywheel train-online`: `build_release` in this process, with the
    step range and the generation and feedback ids the weights were trained on."""

    def __init__(self, config: ReleaseConfig) -> None:
        self.config = config
        self._db: DbEngine | None = None  # the history, for `status` (opened on first use)

    def release(self, candidate: Path, provenance: dict[str, Any], *, requested_by: str,
                reason: str) -> ReleaseOutcome:
        with open_release_context(self.config) as ctx:
            row = build_release(ctx, candidate=candidate, requested_by=requested_by,
                                reason=reason, provenance=provenance)
        return ReleaseOutcome(version=row.version,
                              published=row.status in ("published", "canary"),
                              sha256=row.sha256, reason=row.reason, parent=row.parent,
                              eval_summary=dict(row.eval_summary),
                              canary=row.status == "canary")

    def status(self, version: int) -> str:
        if self._db is None:
            self._db = open_database(self.config.database_url,
                                     [Release.__table__])  # type: ignore[attr-defined]
        with Session(self._db) as session:
            row = session.get(Release, version)
            if row is None:
                raise ReleaseError(f"no release v{version}")
            return row.status
