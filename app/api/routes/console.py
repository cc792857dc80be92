"""The operator console: `GET /console` (one page, its script and style: the project's own
files in app/api/static, nothing fetched from elsewhere) and `GET /admin/console`, the figures
it needs that the other admin routes do not give (app/api/console.py).

The page holds no data and needs no token to load; it asks for the admin token, keeps it in
`sessionStorage` (never in a URL) and sends it as the bearer token of every admin call it
makes: `/admin/status`, `/admin/releases`, `/admin/trainer` and their actions, and this one.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from sqlmodel import col, select

from app.api.console import ConsoleSnapshot, snapshot
from app.api.deps import AdminDep, DbDep, ServicesDep
from app.api.errors import ApiError, error_responses
from app.api.replicas import live_replicas
from trainer.release.pipeline import Release

router = APIRouter(tags=["console"])
STATIC = Path(__file__).resolve().parents[1] / "static"
_ASSETS = {"console.js": "text/javascript", "console.css": "text/css"}


@router.get("/console", include_in_schema=False)
async def console_page() -> FileResponse:
    return FileResponse(STATIC / "console.html", media_type="text/html",
                        headers={"Cache-Control": "no-store"})


@router.get("/console/{asset}", include_in_schema=False)
async def console_asset(asset: str) -> FileResponse:
    if asset not in _ASSETS:  # a fixed set: no path from the request reaches the filesystem
        raise ApiError(404, f"no console asset {asset!r}")
    return FileResponse(STATIC / asset, media_type=_ASSETS[asset],
                        headers={"Cache-Control": "no-store"})


@router.get("/admin/console", response_model=ConsoleSnapshot, tags=["admin"],
            responses=error_responses(401))
def console_figures(services: ServicesDep, db: DbDep, _: AdminDep) -> ConsoleSnapshot:
    """Live acceptance and mean reward per served version, the join's lag per partition,
    experiences produced, the session-log spool, webhook refusals by reason, delta sizes."""
    rows = db.exec(select(Release.version, Release.manifest_uri)
                   .order_by(col(Release.version).desc()).limit(200)).all()
    replicas = [{"id": r.replica_id, "version": r.version, "sha256": r.sha256,
                 "seen_at": r.seen_at.isoformat()} for r in live_replicas(db)]
    # End the transaction before asking Kafka and the artifact store: on SQLite it holds the
    # write lock (ingest/sql.py), and the intake and the trainer wait on it meanwhile
    db.rollback()
    return snapshot(services.console_feeds(), services.metrics, services.engine.version,
                    services.session_log, [(v, uri) for v, uri in rows], replicas)
