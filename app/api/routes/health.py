"""`GET /healthz`: liveness plus the served version (no auth, cheap)."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import ServicesDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz(services: ServicesDep) -> dict[str, str | int]:
    return {"status": "ok", "model_version": services.engine.version.number}
