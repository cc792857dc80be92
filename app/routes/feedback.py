"""`POST /v1/feedback`: a user's judgment of one generation, into the `feedback` topic.

Replies 202 once the broker has acknowledged the event. A repeated `event_id` is accepted
(202, `duplicate: true`) and not produced again; the receipt ledger lives in SQL.
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, status
from kafka.errors import KafkaError
from sqlalchemy.exc import IntegrityError

from app.db import FeedbackReceipt
from app.deps import DbDep, ServicesDep
from app.schemas import FeedbackAccepted, FeedbackRequest
from ingest.events import FeedbackReceived

router = APIRouter(tags=["feedback"])


@router.post("/v1/feedback", status_code=status.HTTP_202_ACCEPTED,
             response_model=FeedbackAccepted)
async def post_feedback(body: FeedbackRequest, services: ServicesDep,
                        db: DbDep) -> FeedbackAccepted:
    if db.get(FeedbackReceipt, body.event_id) is not None:
        services.counters.feedback_duplicates += 1
        return FeedbackAccepted(event_id=body.event_id, duplicate=True)
    try:
        event = FeedbackReceived(**body.model_dump(exclude_none=True))
    except ValueError as exc:  # cross-field rules (e.g. edit_kept needs a value)
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from exc
    try:
        future = services.producer.send(services.kafka.topics.feedback, event.generation_id,
                                        event)
        future.get(timeout=services.kafka.delivery_timeout_ms / 1000)
    except KafkaError as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE,
                            f"feedback log unavailable, retry: {exc}") from exc
    db.add(FeedbackReceipt(event_id=event.event_id, generation_id=event.generation_id,
                           kind=event.kind))
    try:
        db.commit()
    except IntegrityError:  # a concurrent duplicate won the race; the join dedupes
        db.rollback()
    services.counters.feedback_accepted += 1
    return FeedbackAccepted(event_id=event.event_id, duplicate=False)
