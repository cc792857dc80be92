"""The release pipeline: history in SQL, announcements on Kafka (app/tasks.py runs it on Celery).

`build_release`: candidate checkpoint -> eval gate against the served version -> delta (and a
full snapshot every `release.snapshot_every` releases, which resets the chain) in the artifact
store -> `ReleasePublished` on `releases` -> the SQL row marked published. A rejected candidate
is recorded with the reason and never published. `rollback_release` takes the current head
back to its parent by re-announcing the parent: replicas apply the same delta backwards.

The served version ("head") is the newest published release; version 0 is the base model,
recorded as a snapshot the first time the pipeline runs. The weights work (load, gate, encode,
store, the head cache under `<data_dir>/releases/`) is trainer/release.py's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine as DbEngine
from sqlmodel import Session, col, select

from app.db import Release
from app.settings import Settings
from ingest.events import ReleasePublished, utcnow
from ingest.log import EventProducer
from kernels.delta.manifest import VersionRef
from kernels.weights import state_dict_sha256
from trainer.release import (
    ReleaseConfig,
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

__all__ = ["ReleaseConflictError", "ReleaseContext", "ReleaseError", "build_release",
           "release_config", "reserve_version", "rollback_release"]


class ReleaseConflictError(ReleaseError):
    """The request contradicts the release history (e.g. rolling back a non-head version)."""


def release_config(settings: Settings) -> ReleaseConfig:
    return ReleaseConfig(release=settings.release, model_dir=settings.resolved_model_dir,
                         cache_dir=settings.data_dir / "releases",
                         store_url=settings.resolved_artifact_store_url,
                         tasks=settings.bootstrap.tasks,
                         harness=settings.bootstrap.harness(temperature=0.0))


@dataclass
class ReleaseContext:
    """What the pipeline touches: settings, the SQL engine, a producer on `releases`."""

    settings: Settings
    db: DbEngine
    producer: EventProducer

    @property
    def config(self) -> ReleaseConfig:
        return release_config(self.settings)


# ---- history -----------------------------------------------------------------------------
def head(session: Session) -> Release | None:
    """The served version: the newest published release."""
    return session.exec(select(Release).where(Release.status == "published")
                        .order_by(col(Release.version).desc())).first()


def next_version(session: Session) -> int:
    newest = session.exec(select(Release).order_by(col(Release.version).desc())).first()
    return 0 if newest is None else newest.version + 1


def reserve_version(db: DbEngine, *, requested_by: str, reason: str,
                    candidate_uri: str | None) -> int:
    """Record a candidate row now (so an API caller learns its version before the build)."""
    with Session(db) as session:
        version = max(next_version(session), 1)
        session.add(Release(version=version, kind="delta", sha256="", status="candidate",
                            requested_by=requested_by, reason=reason,
                            candidate_uri=candidate_uri))
        session.commit()
        return version


def ensure_base(ctx: ReleaseContext) -> Release:
    """The head, creating version 0 (the base model as a snapshot) on first use."""
    with Session(ctx.db) as session:
        current = head(session)
        if current is not None:
            return current
    weights = base_weights(ctx.settings.resolved_model_dir)
    sha = state_dict_sha256(weights)
    stored = store_base(ctx.config, weights, sha)
    base = Release(version=0, kind="snapshot", status="published",
                   sha256=sha, snapshot_uri=stored.snapshot_uri, manifest_uri=stored.manifest_uri,
                   requested_by="system", reason="base model", published_at=utcnow())
    _publish(ctx, base)
    with Session(ctx.db) as session:
        session.add(base)
        session.commit()
        session.refresh(base)
    return base


def _publish(ctx: ReleaseContext, release: Release, *, kind: str | None = None,
             parent: int | None = None) -> ReleasePublished:
    event = ReleasePublished(
        version=release.version, parent=parent if parent is not None else release.parent,
        kind=kind or release.kind,  # type: ignore[arg-type]
        manifest_uri=release.manifest_uri or release.snapshot_uri or "",
        snapshot_uri=release.snapshot_uri, sha256=release.sha256,
        eval_summary={k: float(v) for k, v in release.eval_summary.items()
                      if isinstance(v, int | float)})
    topic = ctx.settings.topics.releases
    ctx.producer.send(topic, str(release.version), event).get(
        timeout=ctx.settings.kafka.delivery_timeout_ms / 1000)
    return event


# ---- pipeline ----------------------------------------------------------------------------
def build_release(ctx: ReleaseContext, *, candidate: Path | None = None,
                  version: int | None = None, requested_by: str = "system",
                  reason: str = "", provenance: dict[str, Any] | None = None) -> Release:
    """Gate, store, publish one candidate; returns its row (published or rejected)."""
    served = ensure_base(ctx)
    path = candidate or ctx.settings.resolved_candidate_path
    if version is None:
        version = reserve_version(ctx.db, requested_by=requested_by, reason=reason,
                                  candidate_uri=str(path))
    try:
        return _build(ctx, served, path, version, provenance or {})
    except Exception as exc:
        _finish(ctx, version, status="rejected", reason=f"build failed: {exc}")
        raise


def _build(ctx: ReleaseContext, served: Release, path: Path, version: int,
           provenance: dict[str, Any]) -> Release:
    config = ctx.config
    served_weights = head_weights(config, served.version, served.sha256)
    weights = load_candidate(path, config.model_dir)
    sha = state_dict_sha256(weights)
    decision = evaluate(config, served_weights, weights)
    if not decision.passed:
        return _finish(ctx, version, status="rejected", sha256=sha, reason=decision.reason,
                       eval_summary=decision.summary(), parent=served.version)
    chain = served.chain_length + 1
    snapshot = chain >= ctx.settings.release.snapshot_every
    stored = store_release(config, served_weights, weights,
                           base=VersionRef(version=served.version, sha256=served.sha256),
                           target=VersionRef(version=version, sha256=sha), snapshot=snapshot)
    with Session(ctx.db) as session:
        row = session.get(Release, version)
        assert row is not None
        row.sqlmodel_update({
            "parent": served.version, "sha256": sha, "manifest_uri": stored.manifest_uri,
            "snapshot_uri": stored.snapshot_uri, "kind": "snapshot" if snapshot else "delta",
            "chain_length": 0 if snapshot else chain, "eval_summary": decision.summary(),
            "step_range": provenance.get("step_range"),
            "generation_ids": provenance.get("generation_ids", []),
            "feedback_event_ids": provenance.get("feedback_event_ids", [])})
        _publish(ctx, row)
        row.status, row.published_at = "published", utcnow()
        session.add(row)
        session.commit()
        session.refresh(row)
    save_weights(weights, config.head_cache)
    log.info("published v%d (parent v%d, %s)", version, served.version, decision.reason)
    return row


def _finish(ctx: ReleaseContext, version: int, *, status: str, reason: str,
            **fields: Any) -> Release:
    with Session(ctx.db) as session:
        row = session.get(Release, version)
        if row is None:
            raise ReleaseError(f"no release v{version}")
        row.sqlmodel_update({"status": status, "reason": reason, **fields})
        session.add(row)
        session.commit()
        session.refresh(row)
        log.warning("v%d %s: %s", version, status, reason)
        return row


def rollback_release(ctx: ReleaseContext, version: int, *, requested_by: str = "admin",
                     reason: str = "") -> Release:
    """Take the head `version` back to its parent; returns the parent (the new head)."""
    with Session(ctx.db) as session:
        row = session.get(Release, version)
        current = head(session)
        if row is None:
            raise ReleaseError(f"no release v{version}")
        if current is None or current.version != version:
            raise ReleaseConflictError(
                f"v{version} is {row.status}, not the served head "
                f"(v{current.version if current else '-'}); only the head can be rolled back")
        parent = session.get(Release, row.parent) if row.parent is not None else None
        if parent is None or parent.status != "published":
            raise ReleaseConflictError(f"v{version} has no published parent to return to")
        event = ReleasePublished(version=parent.version, parent=version, kind="rollback",
                                 manifest_uri=row.manifest_uri or "",
                                 snapshot_uri=parent.snapshot_uri, sha256=parent.sha256,
                                 eval_summary={})
        ctx.producer.send(ctx.settings.topics.releases, str(parent.version), event).get(
            timeout=ctx.settings.kafka.delivery_timeout_ms / 1000)
        row.sqlmodel_update({"status": "rolled_back", "rolled_back_at": utcnow(),
                             "rolled_back_by": requested_by, "rollback_reason": reason})
        session.add(row)
        session.commit()
        session.refresh(parent)
        return parent


class PipelineReleaseSink:
    """The online trainer's `ReleaseSink`: hands a candidate to `build_release` (gate, delta,
    record, publish), in this process, with the step range and ids the weights were trained on."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    def release(self, candidate: Any, provenance: dict[str, Any], *, requested_by: str,
                reason: str) -> Any:
        from app.tasks import release_context
        from trainer.online import ReleaseOutcome

        with release_context(self.settings) as ctx:
            row = build_release(ctx, candidate=candidate, requested_by=requested_by,
                                reason=reason, provenance=provenance)
        return ReleaseOutcome(version=row.version, published=row.status == "published",
                              sha256=row.sha256, reason=row.reason)
