"""Release admin (bearer token): trigger, list, inspect, roll back.

    POST /admin/releases                      202 {version, task_id}: a Celery build_release
    GET  /admin/releases                      newest first
    GET  /admin/releases/{version}
    POST /admin/releases/{version}/rollback   re-announce the parent; replicas swap back
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Query, status
from sqlmodel import col, select

from app.db import Release
from app.deps import AdminDep, DbDep, ServicesDep
from app.schemas import ReleaseOut, ReleaseQueued, ReleaseRequest, RollbackRequest

router = APIRouter(prefix="/admin/releases", tags=["releases"])


@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=ReleaseQueued)
def trigger_release(services: ServicesDep, _: AdminDep,
                    body: ReleaseRequest | None = None) -> ReleaseQueued:
    from app.celery_app import RELEASE_TASK
    from app.releases import reserve_version

    body = body or ReleaseRequest()
    candidate = body.candidate or str(services.settings.resolved_candidate_path)
    version = reserve_version(services.db, requested_by=body.requested_by, reason=body.reason,
                              candidate_uri=candidate)
    result = services.release_tasks().send_task(RELEASE_TASK, kwargs={
        "version": version, "candidate": candidate, "requested_by": body.requested_by,
        "reason": body.reason})
    return ReleaseQueued(version=version, task_id=result.id)


@router.get("", response_model=list[ReleaseOut])
def list_releases(db: DbDep, _: AdminDep, limit: int = Query(default=50, ge=1, le=1000),
                  status_is: str | None = Query(default=None, alias="status")
                  ) -> list[Release]:
    query = select(Release).order_by(col(Release.version).desc()).limit(limit)
    if status_is is not None:
        query = query.where(Release.status == status_is)
    return list(db.exec(query).all())


@router.get("/{version}", response_model=ReleaseOut)
def get_release(version: int, db: DbDep, _: AdminDep) -> Release:
    release = db.get(Release, version)
    if release is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no release v{version}")
    return release


@router.post("/{version}/rollback", response_model=ReleaseOut)
def rollback(version: int, services: ServicesDep, _: AdminDep,
             body: RollbackRequest | None = None) -> Release:
    """Roll the served head back to its parent; returns the parent (the new head)."""
    from app.releases import (
        ReleaseConflictError,
        ReleaseContext,
        ReleaseError,
        rollback_release,
    )

    body = body or RollbackRequest()
    ctx = ReleaseContext(settings=services.settings, db=services.db, producer=services.producer)
    try:
        return rollback_release(ctx, version, requested_by=body.requested_by,
                                reason=body.reason)
    except ReleaseConflictError as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
    except ReleaseError as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from exc
