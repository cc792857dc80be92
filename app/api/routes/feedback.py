"""`POST /v1/feedback` and `POST /v1/feedback/batch`: signed webhooks into the `feedback` topic.

`SignedRoute` checks the raw body against `Flywheel-Signature` (ingest/signing.py) before
FastAPI reads it: a missing, unmatched or stale signature is 401, the body never parsed.
FastAPI then validates it into `FeedbackRequest` (or `FeedbackBatchRequest`, app/api/schemas.py),
which becomes the wire event without a second validation: a bad one is 422 naming the field
(one naming both a generation and a session, or neither, too). A body over `max_body_bytes`
(cut as it streams in, app/api/guard.py) or more events than `feedback_batch_max` is 413; 503
while the broker or the receipt ledger is unavailable; errors in the API's one shape.

Replies 202 once the broker has acknowledged every new event, keyed by the generation or
session it judges; a repeated `event_id` is accepted (`duplicate: true`) and not produced
again (app/api/feedback_intake.py: receipts in SQL, recent ids in memory). Refusals are counted
by reason in `flywheel_feedback_rejected_total` (app/api/metrics.py; a body refused by its
declared Content-Length in app/api/guard.py, before any route, is not among them).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from fastapi import APIRouter, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

from app.api.deps import ServicesDep, get_services
from app.api.errors import ApiError, BodyTooLarge, error_responses
from app.api.feedback_intake import FeedbackLogUnavailable
from app.api.schemas import (
    FeedbackAccepted,
    FeedbackBatchAccepted,
    FeedbackBatchRequest,
    FeedbackRequest,
)
from app.api.services import Services
from app.settings import Settings
from ingest.events import FeedbackReceived, is_private_generation
from ingest.signing import SIGNATURE_HEADER, SignatureError, verify


def check_signature(settings: Settings, header: str | None, body: bytes) -> None:
    """401 unless `header` signs `body` with an active secret; no secrets: anything goes."""
    if not settings.feedback_secrets:
        return
    secrets = [s.get_secret_value() for s in settings.feedback_secrets]
    try:
        verify(header, body, secrets, tolerance_s=settings.feedback_tolerance_s)
    except SignatureError as exc:
        raise ApiError(status.HTTP_401_UNAUTHORIZED, str(exc),
                       code="invalid_signature") from exc


def rejection_reason(exc: Exception) -> str | None:
    """The `flywheel_feedback_rejected_total` reason of a refusal, None if not one."""
    if isinstance(exc, RequestValidationError):
        return "invalid_body"
    if isinstance(exc, BodyTooLarge):
        return "request_too_large"
    if isinstance(exc, ApiError):
        if exc.status_code == status.HTTP_503_SERVICE_UNAVAILABLE:
            return "log_unavailable"
        return {"invalid_signature": "invalid_signature", "batch_too_large": "batch_too_large",
                "request_too_large": "request_too_large",
                "private_generation": "private_generation"}.get(exc.code or "", "invalid_body")
    return None


class SignedRoute(APIRoute):
    """An APIRoute whose request is checked by `check_signature` on the raw body before
    FastAPI parses and validates that body; refusals are counted by reason."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        parse_and_handle = super().get_route_handler()

        async def signed_then_handled(request: Request) -> Response:
            services = await get_services(request)
            try:
                try:
                    body = await request.body()  # held to max_body_bytes by app/api/guard.py
                except ClientDisconnect as exc:
                    raise ApiError(status.HTTP_400_BAD_REQUEST,
                                   "the client went away while sending the body") from exc
                check_signature(services.settings, request.headers.get(SIGNATURE_HEADER), body)
                return await parse_and_handle(request)  # FastAPI reads the body Request kept
            except (ApiError, RequestValidationError, BodyTooLarge) as exc:
                reason = rejection_reason(exc)
                if reason is not None:
                    services.metrics.reject_feedback(reason)
                raise

        return signed_then_handled


# a body without a content-type is read as JSON too, as webhook senders expect
router = APIRouter(tags=["feedback"], route_class=SignedRoute, strict_content_type=False)
_ERRORS = error_responses(401, 422, 503)  # + 400, 413, 500: app.api.main
_SIGNED = {"parameters": [{
    "name": SIGNATURE_HEADER, "in": "header", "required": False, "schema": {"type": "string"},
    "description": "t=<unix seconds>,v1=<hex HMAC-SHA256 of '<t>.<body>'>; required when "
                   "secrets are set"}]}


@router.post("/v1/feedback", status_code=status.HTTP_202_ACCEPTED, responses=_ERRORS,
             response_model=FeedbackAccepted, openapi_extra=_SIGNED)
async def post_feedback(event: FeedbackRequest, services: ServicesDep) -> Response:
    refuse_private([event], "generation_id")
    [duplicate] = await accept(services, [event.event()])
    return _accepted(FeedbackAccepted(event_id=event.event_id, duplicate=duplicate))


@router.post("/v1/feedback/batch", status_code=status.HTTP_202_ACCEPTED, responses=_ERRORS,
             response_model=FeedbackBatchAccepted, openapi_extra=_SIGNED)
async def post_feedback_batch(batch: FeedbackBatchRequest, services: ServicesDep) -> Response:
    events, limit = batch.events, services.settings.feedback_batch_max
    if len(events) > limit:
        raise ApiError(status.HTTP_413_CONTENT_TOO_LARGE,
                       f"batch of {len(events)} events exceeds {limit}", param="events",
                       code="batch_too_large")
    refuse_private(events, "events.{}.generation_id")
    duplicates = await accept(services, [e.event() for e in events])
    repeated = sum(duplicates)
    return _accepted(FeedbackBatchAccepted(
        accepted=len(events) - repeated, duplicates=repeated,
        results=[FeedbackAccepted(event_id=e.event_id, duplicate=d)
                 for e, d in zip(events, duplicates, strict=True)]))


def _accepted(reply: FeedbackAccepted | FeedbackBatchAccepted) -> Response:
    """202 with `reply` serialized by its model. Returned as a Response, it is not validated
    a second time by FastAPI against the route's `response_model` (which still documents it):
    that took about a sixth of a single event's CPU on the event loop."""
    return Response(reply.model_dump_json(), status.HTTP_202_ACCEPTED,
                    media_type="application/json")


def refuse_private(events: Sequence[FeedbackRequest], param: str) -> None:
    """422 for feedback about a generation served in privacy mode: it was never logged, and
    never trains (the whole request refused, counted as `private_generation`)."""
    for i, event in enumerate(events):
        if is_private_generation(event.generation_id):
            raise ApiError(status.HTTP_422_UNPROCESSABLE_CONTENT, f"{event.generation_id} was "
                           "served in privacy mode: it is not logged and takes no feedback",
                           param=param.format(i), code="private_generation")


async def accept(services: Services, events: Sequence[FeedbackReceived]) -> list[bool]:
    """Hand `events` to the intake and count them; one duplicate flag per event."""
    try:
        duplicates = await services.feedback_intake().accept(events)
    except FeedbackLogUnavailable as exc:
        raise ApiError(status.HTTP_503_SERVICE_UNAVAILABLE,
                       f"feedback log unavailable, retry: {exc}") from exc
    repeated = sum(duplicates)
    services.counters.feedback_duplicates += repeated
    services.counters.feedback_accepted += len(events) - repeated
    services.metrics.observe_feedback(new=len(events) - repeated, duplicates=repeated)
    return duplicates
