"""A canary's end: promote the release to every session, or roll it back to its parent.

`build_release` (trainer/release/pipeline.py) announces a release that passed the gate with
`canary_share` when `release.canary.enabled`, and marks its row "canary"; its parent stays the
head. The canary's test (trainer/release/canary_watch.py) or an admin then ends it here:

- `promote_canary`: the same release announced again without a share; every replica's
  primary engine hot-swaps to it (the release's own delta) and closes its canary engine. The
  row becomes "published": the new head.
- `rollback_canary`: the parent announced again (kind "rollback"); replicas close the canary
  engine, and their primary, on the parent throughout, does not move. The row becomes
  "rolled_back".

Each decision is claimed on the row (status "canary" -> the decision) in the transaction that
announces it, so of several deciders (one per API replica) exactly one announces. The
`canary` table keeps each canary's figures (both arms, the interval, the decision, who
decided) for the console and the admin API.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from sqlalchemy import JSON, Column
from sqlalchemy import Engine as DbEngine
from sqlmodel import Field, Session, SQLModel, col, select

from ingest.events import ReleasePublished, utcnow
from trainer.release.pipeline import (
    Release,
    ReleaseConflictError,
    ReleaseContext,
    ReleaseError,
    announce,
    announcement,
)

CanaryStatus = Literal["running", "held", "promoted", "rolled_back"]


class CanaryRun(SQLModel, table=True):
    """One release's canary: its share, the test's latest figures, and how it ended."""

    __tablename__ = "canary"

    version: int = Field(primary_key=True)
    parent: int
    share: float
    status: str = Field(default="running", max_length=16, index=True)  # a CanaryStatus
    # CanaryTest.figures(): per metric, both arms' means and sessions, the difference and
    # its 95% interval, the log-likelihood ratio, the metric's decision
    figures: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON))
    started_at: datetime
    updated_at: datetime = Field(default_factory=utcnow)
    decided_at: datetime | None = None
    decided_by: str | None = Field(default=None, max_length=128)
    reason: str = Field(default="", max_length=2000)


TABLES = [CanaryRun.__table__, Release.__table__]  # type: ignore[attr-defined]


def canary_run(db: DbEngine, release: Release, share: float) -> CanaryRun:
    """The `canary` row of `release` (in its canary), made on first use."""
    with Session(db) as session:
        run = session.get(CanaryRun, release.version)
        if run is None:
            assert release.parent is not None and release.published_at is not None
            run = CanaryRun(version=release.version, parent=release.parent, share=share,
                            started_at=release.published_at)
            session.add(run)
            session.commit()
            session.refresh(run)
        return run


def note_figures(db: DbEngine, version: int, figures: dict[str, Any], *,
                 status: CanaryStatus | None = None, reason: str | None = None) -> None:
    """The test's latest figures on the canary's row (and "held" once it reached its cap)."""
    with Session(db) as session:
        run = session.get(CanaryRun, version)
        if run is None or run.status in ("promoted", "rolled_back"):
            return
        run.figures, run.updated_at = figures, utcnow()
        if status is not None:
            run.status = status
        if reason is not None:
            run.reason = reason
        session.add(run)
        session.commit()


def promote_canary(ctx: ReleaseContext, version: int, *, decided_by: str, reason: str,
                   figures: dict[str, Any] | None = None) -> Release:
    """Serve the canary `version` to every session; returns its row (now the head)."""
    return _end(ctx, version, "promoted", decided_by=decided_by, reason=reason,
                figures=figures)


def rollback_canary(ctx: ReleaseContext, version: int, *, decided_by: str, reason: str,
                    figures: dict[str, Any] | None = None) -> Release:
    """End the canary `version` and keep its parent for every session; returns its row."""
    return _end(ctx, version, "rolled_back", decided_by=decided_by, reason=reason,
                figures=figures)


def _end(ctx: ReleaseContext, version: int, decision: Literal["promoted", "rolled_back"], *,
         decided_by: str, reason: str, figures: dict[str, Any] | None) -> Release:
    with Session(ctx.db) as session:
        row = session.get(Release, version, with_for_update=True)  # the claim (module doc)
        if row is None:
            raise ReleaseError(f"no release v{version}")
        if row.status != "canary":
            raise ReleaseConflictError(f"v{version} is {row.status}, not in its canary")
        parent = session.get(Release, row.parent) if row.parent is not None else None
        if parent is None:
            raise ReleaseConflictError(f"v{version} has no parent to return to")
        now = utcnow()
        if decision == "promoted":
            announce(ctx, announcement(row))  # the same release, now for every session
            row.status = "published"
        else:
            announce(ctx, ReleasePublished(
                version=parent.version, parent=version, kind="rollback",
                manifest_uri=row.manifest_uri or "", snapshot_uri=parent.snapshot_uri,
                sha256=parent.sha256))
            row.sqlmodel_update({"status": "rolled_back", "rolled_back_at": now,
                                 "rolled_back_by": decided_by, "rollback_reason": reason})
        run = session.get(CanaryRun, version) or CanaryRun(
            version=version, parent=parent.version, share=0.0,
            started_at=row.published_at or now)
        run.sqlmodel_update({"status": decision, "decided_at": now, "decided_by": decided_by,
                             "reason": reason, "updated_at": now})
        if figures is not None:
            run.figures = figures
        session.add(row)
        session.add(run)
        session.commit()  # the claim: a second decider finds the row no longer "canary"
        session.refresh(row)
        return row


def recent_canaries(db: DbEngine, limit: int = 10) -> list[CanaryRun]:
    """The newest canaries first, with their figures and decisions."""
    with Session(db) as session:
        return list(session.exec(select(CanaryRun).order_by(col(CanaryRun.version).desc())
                                 .limit(limit)).all())
