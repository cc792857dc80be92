"""Release admin (bearer token): trigger, list, inspect, roll back (trainer/release/pipeline.py).

    POST /admin/releases                      202 {version, task_id}: a Celery build_release
    GET  /admin/releases                      newest first
    GET  /admin/releases/{version}
    POST /admin/releases/{version}/rollback   re-announce the parent; replicas swap back (a
                                              release in its canary: the canary ends)
    POST /admin/releases/{version}/promote    a release in its canary, to every session
    GET  /admin/releases/canaries             the newest canaries, their figures, decisions

A version is a 64-bit integer (the database's); a requested candidate must be a checkpoint
that exists under the data dir or the local artifact store (or be the configured
`release.candidate_path`): anything else is refused before a version is reserved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query, status
from fastapi import Path as PathParam
from sqlmodel import Session, col, select

from app.api.deps import AdminDep, DbDep, ServicesDep
from app.api.errors import ApiError, error_responses
from app.api.schemas import (
    CanaryOut,
    PromoteRequest,
    ReleaseOut,
    ReleaseQueued,
    ReleaseRequest,
    RollbackRequest,
)
from app.jobs.celery_app import RELEASE_TASK
from app.settings import Settings
from kernels.delta.store import LocalStoreConfig, artifact_store_config
from trainer.release.canary_stage import (
    CanaryRun,
    promote_canary,
    recent_canaries,
    rollback_canary,
)
from trainer.release.pipeline import (
    Release,
    ReleaseConflictError,
    ReleaseContext,
    ReleaseError,
    ReleaseStatus,
    reserve_version,
    rollback_release,
)

router = APIRouter(prefix="/admin/releases", tags=["releases"])
Version = Annotated[int, PathParam(ge=0, le=2**63 - 1, description="a release version")]


def confined_candidate(settings: Settings, requested: str | None) -> Path:
    """The checkpoint a release request names, refused (400/404) unless it is the configured
    candidate or lies under the data dir or the local artifact store, and exists."""
    configured = settings.resolved_candidate_path.resolve()
    try:
        path = configured if requested is None else Path(requested).resolve()
        exists = path.exists()
    except (OSError, ValueError) as exc:  # a NUL byte, a name too long for the filesystem
        raise ApiError(400, f"candidate: not a usable path ({exc})", param="candidate",
                       code="path_not_allowed") from exc
    if requested is not None and path != configured:
        store = artifact_store_config(settings.resolved_artifact_store_url)
        roots = [settings.data_dir.resolve()]
        if isinstance(store, LocalStoreConfig):
            roots.append(store.root.resolve())
        if not any(path.is_relative_to(root) for root in roots):
            raise ApiError(400, f"candidate {requested} lies outside the data dir and the "
                           "artifact store", param="candidate", code="path_not_allowed")
    if not exists:
        raise ApiError(404, f"no candidate checkpoint at {path} (has the trainer written "
                       "one?)", param="candidate", code="candidate_not_found")
    return path


@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=ReleaseQueued,
             responses=error_responses(400, 401, 404, 422))
def trigger_release(services: ServicesDep, _: AdminDep,
                    body: ReleaseRequest | None = None) -> ReleaseQueued:
    body = body or ReleaseRequest()
    candidate = str(confined_candidate(services.settings, body.candidate))
    version = reserve_version(services.db, requested_by=body.requested_by, reason=body.reason,
                              candidate_uri=candidate)
    result = services.release_tasks().send_task(RELEASE_TASK, kwargs={
        "version": version, "candidate": candidate, "requested_by": body.requested_by,
        "reason": body.reason})
    return ReleaseQueued(version=version, task_id=result.id)


@router.get("", response_model=list[ReleaseOut], responses=error_responses(401, 422))
def list_releases(db: DbDep, _: AdminDep,
                  limit: Annotated[int, Query(ge=1, le=1000)] = 50,
                  status_is: Annotated[ReleaseStatus | None, Query(alias="status")] = None
                  ) -> list[Release]:
    query = select(Release).order_by(col(Release.version).desc()).limit(limit)
    if status_is is not None:
        query = query.where(Release.status == status_is)
    return list(db.exec(query).all())


@router.get("/canaries", response_model=list[CanaryOut], responses=error_responses(401, 422))
def list_canaries(services: ServicesDep, _: AdminDep,
                  limit: Annotated[int, Query(ge=1, le=100)] = 10) -> list[CanaryRun]:
    return recent_canaries(services.db, limit)


@router.get("/{version}", response_model=ReleaseOut, responses=error_responses(401, 404, 422))
def get_release(version: Version, db: DbDep, _: AdminDep) -> Release:
    release = db.get(Release, version)
    if release is None:
        raise ApiError(status.HTTP_404_NOT_FOUND, f"no release v{version}")
    return release


@router.post("/{version}/rollback", response_model=ReleaseOut,
             responses=error_responses(401, 404, 409, 422))
def rollback(version: Version, services: ServicesDep, _: AdminDep,
             body: RollbackRequest | None = None) -> Release:
    """Roll the served head back to its parent, or end a release's canary (its parent stays
    served); returns the parent (the head)."""
    body = body or RollbackRequest()
    ctx = ReleaseContext(services.settings.release_config(), services.db, services.producer)
    with Session(services.db) as session:  # closed before the rollback writes (SQLite's lock)
        row = session.get(Release, version)
        in_canary = row is not None and row.status == "canary"
    try:
        if in_canary:
            ended = rollback_canary(ctx, version, decided_by=body.requested_by,
                                    reason=body.reason)
            with Session(services.db) as session:
                parent = session.get(Release, ended.parent) if ended.parent is not None else None
            if parent is None:
                raise ReleaseError(f"v{version} has no parent")
            return parent
        return rollback_release(ctx, version, requested_by=body.requested_by,
                                reason=body.reason)
    except ReleaseConflictError as exc:
        raise ApiError(status.HTTP_409_CONFLICT, str(exc)) from exc
    except ReleaseError as exc:
        raise ApiError(status.HTTP_404_NOT_FOUND, str(exc)) from exc


@router.post("/{version}/promote", response_model=ReleaseOut,
             responses=error_responses(401, 404, 409, 422))
def promote(version: Version, services: ServicesDep, _: AdminDep,
            body: PromoteRequest | None = None) -> Release:
    """Serve a release in its canary to every session (a held canary's admin decision);
    returns it (the new head)."""
    body = body or PromoteRequest()
    ctx = ReleaseContext(services.settings.release_config(), services.db, services.producer)
    try:
        return promote_canary(ctx, version, decided_by=body.requested_by, reason=body.reason)
    except ReleaseConflictError as exc:
        raise ApiError(status.HTTP_409_CONFLICT, str(exc)) from exc
    except ReleaseError as exc:
        raise ApiError(status.HTTP_404_NOT_FOUND, str(exc)) from exc
