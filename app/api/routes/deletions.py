"""A user's deletion (admin bearer token): `POST /admin/deletions` forgets every generation of
one user up to now (what the join holds, what waits to be trained; `ingest.deletions`) and
answers with the record; `GET /admin/deletions` lists the records, newest first.
`flywheel users delete USER` does the same from the command line."""

from __future__ import annotations

from fastapi import APIRouter, Query, status
from starlette.concurrency import run_in_threadpool

from app.api.deps import AdminDep, ServicesDep
from app.api.errors import error_responses
from app.api.schemas import DeletionInfo, DeletionRequest
from ingest.deletions import delete_user, list_deletions

router = APIRouter(prefix="/admin/deletions", tags=["admin"])


@router.post("", status_code=status.HTTP_201_CREATED, response_model=DeletionInfo,
             responses=error_responses(401, 422))
async def delete(body: DeletionRequest, services: ServicesDep, _: AdminDep) -> DeletionInfo:
    record = await run_in_threadpool(  # SQL and Kafka acks: off the event loop
        delete_user, services.db, services.join_database(), body.user_id,
        requested_by="admin", reason=body.reason, kafka=services.kafka)
    return DeletionInfo.model_validate(record, from_attributes=True)


@router.get("", response_model=list[DeletionInfo], responses=error_responses(401, 422))
def deletions(services: ServicesDep, _: AdminDep,
              limit: int = Query(default=100, ge=1, le=1000)) -> list[DeletionInfo]:
    return [DeletionInfo.model_validate(row, from_attributes=True)
            for row in list_deletions(services.db, limit=limit)]
