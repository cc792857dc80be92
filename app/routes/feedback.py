"""`POST /v1/feedback` and `POST /v1/feedback/batch`: signed webhooks into the `feedback` topic.

The raw body (a FeedbackRequest, or {"events": [...]} for the batch) is checked against
`Flywheel-Signature` (ingest/signing.py) before it is parsed: missing, unmatched or stale
signatures are 401; an unreadable body is 422 naming the field; more bytes than
`max_body_bytes` or more events than `feedback_batch_max` is 413. Replies 202 once the broker
has acknowledged every new event; a repeated `event_id` is accepted (`duplicate: true`) and
not produced again (the receipt ledger lives in SQL).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from app.deps import ServicesDep
from app.feedback_intake import FeedbackIntake, FeedbackLogUnavailable
from app.schemas import (
    FeedbackAccepted,
    FeedbackBatchAccepted,
    FeedbackBatchRequest,
    FeedbackRequest,
)
from app.services import Services
from ingest.events import FeedbackReceived
from ingest.signing import SIGNATURE_HEADER, SignatureError, verify

router = APIRouter(tags=["feedback"])


def intake(services: Services) -> FeedbackIntake:
    if services.feedback is None:  # services built outside `build_services` (tests)
        services.feedback = FeedbackIntake(
            producer=services.producer, topic=services.kafka.topics.feedback, db=services.db,
            delivery_timeout_s=services.kafka.delivery_timeout_ms / 1000)
    return services.feedback


async def signed_body(request: Request, services: Services) -> bytes:
    settings = services.settings
    body = await request.body()
    if len(body) > settings.max_body_bytes:  # chunked bodies skip the Content-Length check
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE,
                            f"body of {len(body)} bytes exceeds {settings.max_body_bytes}")
    secrets = [s.get_secret_value() for s in settings.feedback_secrets]
    if secrets:
        try:
            verify(request.headers.get(SIGNATURE_HEADER), body, secrets,
                   tolerance_s=settings.feedback_tolerance_s)
        except SignatureError as exc:
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, str(exc)) from exc
    return body


def parse(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(_located(exc, ("body",))) from exc


def to_event(request: FeedbackRequest, loc: tuple[str | int, ...]) -> FeedbackReceived:
    try:
        return FeedbackReceived(**request.model_dump(exclude_none=True))
    except ValidationError as exc:  # cross-field rules, e.g. edit_kept needs a value
        raise RequestValidationError(_located(exc, loc)) from exc


def _located(exc: ValidationError, prefix: tuple[str | int, ...]) -> list[dict[str, Any]]:
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    return [{**e, "loc": (*prefix, *e["loc"])} for e in errors]


async def accept(services: Services, events: list[FeedbackReceived]) -> list[bool]:
    try:
        duplicates = await intake(services).accept(events)
    except FeedbackLogUnavailable as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE,
                            f"feedback log unavailable, retry: {exc}") from exc
    repeated = sum(duplicates)
    services.counters.feedback_duplicates += repeated
    services.counters.feedback_accepted += len(events) - repeated
    return duplicates


@router.post("/v1/feedback", status_code=status.HTTP_202_ACCEPTED,
             response_model=FeedbackAccepted)
async def post_feedback(request: Request, services: ServicesDep) -> FeedbackAccepted:
    body = await signed_body(request, services)
    event = to_event(parse(FeedbackRequest, body), ("body",))
    [duplicate] = await accept(services, [event])
    return FeedbackAccepted(event_id=event.event_id, duplicate=duplicate)


@router.post("/v1/feedback/batch", status_code=status.HTTP_202_ACCEPTED,
             response_model=FeedbackBatchAccepted)
async def post_feedback_batch(request: Request, services: ServicesDep) -> FeedbackBatchAccepted:
    body = await signed_body(request, services)
    batch: FeedbackBatchRequest = parse(FeedbackBatchRequest, body)
    limit = services.settings.feedback_batch_max
    if len(batch.events) > limit:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE,
                            f"batch of {len(batch.events)} events exceeds {limit}")
    events = [to_event(r, ("body", "events", i)) for i, r in enumerate(batch.events)]
    duplicates = await accept(services, events)
    results = [FeedbackAccepted(event_id=e.event_id, duplicate=d)
               for e, d in zip(events, duplicates, strict=True)]
    return FeedbackBatchAccepted(accepted=len(events) - sum(duplicates),
                                 duplicates=sum(duplicates), results=results)
