"""Online trainer admin (bearer token): pause, resume, release now, status.

    POST /admin/trainer/pause      202 {command_id}: the trainer stops taking batches
    POST /admin/trainer/resume     202 {command_id}
    POST /admin/trainer/release    202 {command_id}: hand the current weights to the release
                                   pipeline now, with their step range and ids
    GET  /admin/trainer            the trainer's status row (step, consumed, lag, last release)
                                   and the reward-hacking monitors' newest breaches (a breach
                                   pauses the trainer and holds its releases; resume
                                   acknowledges it)

The trainer is another process; these write to the SQL command queue it polls
(trainer/online/control.py) and read the status row it keeps.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, status
from pydantic import BaseModel, Field

from app.api.deps import AdminDep, ServicesDep
from app.api.errors import error_responses

router = APIRouter(prefix="/admin/trainer", tags=["trainer"])


class TrainerCommandQueued(BaseModel):
    command_id: int
    kind: str


class TrainerCommandRequest(BaseModel):
    requested_by: str = Field(default="admin", max_length=128)
    reason: str = Field(default="", max_length=2000)


class TrainerStatusOut(BaseModel):
    trainer: dict[str, Any] | None  # None until a trainer has reported


def trainer_status(services: Any) -> dict[str, Any] | None:
    """The status row as JSON with the monitors' newest breaches, or None before any trainer
    reported (used by /admin/status)."""
    from trainer.online.control import ensure_control_tables, read_status, recent_breaches

    db = ensure_control_tables(services.db)
    row = read_status(db)
    if row is None:
        return None
    breaches = [b.model_dump(mode="json", exclude={"id"}) for b in recent_breaches(db)]
    return {**row.model_dump(mode="json", exclude={"id"}), "breaches": breaches}


_ERRORS = error_responses(401, 422)


def _enqueue(services: Any, kind: str, body: TrainerCommandRequest | None
             ) -> TrainerCommandQueued:
    from trainer.online.control import enqueue_command, ensure_control_tables

    body = body or TrainerCommandRequest()
    command_id = enqueue_command(ensure_control_tables(services.db), kind,  # type: ignore[arg-type]
                                 requested_by=body.requested_by, reason=body.reason)
    return TrainerCommandQueued(command_id=command_id, kind=kind)


@router.post("/pause", status_code=status.HTTP_202_ACCEPTED,
             response_model=TrainerCommandQueued, responses=_ERRORS)
def pause(services: ServicesDep, _: AdminDep,
          body: TrainerCommandRequest | None = None) -> TrainerCommandQueued:
    return _enqueue(services, "pause", body)


@router.post("/resume", status_code=status.HTTP_202_ACCEPTED,
             response_model=TrainerCommandQueued,
             responses=_ERRORS)
def resume(services: ServicesDep, _: AdminDep,
           body: TrainerCommandRequest | None = None) -> TrainerCommandQueued:
    return _enqueue(services, "resume", body)


@router.post("/release", status_code=status.HTTP_202_ACCEPTED,
             response_model=TrainerCommandQueued,
             responses=_ERRORS)
def release(services: ServicesDep, _: AdminDep,
            body: TrainerCommandRequest | None = None) -> TrainerCommandQueued:
    return _enqueue(services, "release", body)


@router.get("", response_model=TrainerStatusOut, responses=error_responses(401))
def get_status(services: ServicesDep, _: AdminDep) -> TrainerStatusOut:
    return TrainerStatusOut(trainer=trainer_status(services))
