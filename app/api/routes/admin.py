"""Operator endpoints (bearer token): `GET /admin/status`."""

from __future__ import annotations

import time

from fastapi import APIRouter

from app.api.deps import AdminDep, ServicesDep
from app.api.errors import error_responses
from app.api.routes.trainer import trainer_status
from app.api.schemas import StatusResponse

router = APIRouter(prefix="/admin", tags=["admin"])


@router.get("/status", response_model=StatusResponse, responses=error_responses(401))
def admin_status(services: ServicesDep, _: AdminDep) -> StatusResponse:
    # a def: the trainer's status is a SQL read, which must not hold up the event loop
    version = services.engine.version
    return StatusResponse(
        profile=services.settings.profile, model_version=version.number,
        model_sha256=version.sha256, system_fingerprint=version.fingerprint,
        kafka_bootstrap=services.kafka.bootstrap,
        uptime_s=time.monotonic() - services.started_at,
        completions=services.counters.completions,
        feedback_accepted=services.counters.feedback_accepted,
        feedback_duplicates=services.counters.feedback_duplicates,
        replica=services.replica.status() if services.replica is not None else None,
        trainer=trainer_status(services),
        scavenger=services.scavenger.status() if services.scavenger is not None else None)
