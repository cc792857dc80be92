"""`POST /v1/feedback` and `POST /v1/feedback/batch`: signed webhooks into the `feedback` topic.

The raw body (a FeedbackRequest, or {"events": [...]} for the batch) is checked against
`Flywheel-Signature` (ingest/signing.py) before it is parsed: missing, unmatched or stale
signatures are 401; an unreadable body is 422 naming the field (an event judges one
generation or one whole session: one with both `generation_id` and `session_id`, or neither,
is 422 saying so); the event is produced keyed by whichever it names; more bytes than
`max_body_bytes` (cut while it streams in, app/guard.py) or more events than
`feedback_batch_max` is 413. Errors come in the API's one shape (app/errors.py). Replies
202 once the broker has acknowledged every new event; a repeated `event_id` is accepted
(`duplicate: true`) and not produced again (the receipt ledger lives in SQL, recent ids in
memory).

These are the hottest routes of the app, so they stay lean: `FeedbackFastPath` (installed by
`app.main.create_app` inside app/guard.py's `RequestGuard`) answers them in plain ASGI before the
other middleware and the router; the body is validated once, straight into
`FeedbackReceived` (pydantic-core on the bytes), and the reply serialized by hand. The
APIRoutes below share `handle` with it: they document the routes (request body, every
status) and serve them where the middleware is absent.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request, Response, status
from pydantic import BaseModel, Field, ValidationError, field_validator
from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import ApiError, error_responses, request_id_of, validation_error
from app.feedback_intake import FeedbackIntake, FeedbackLogUnavailable
from app.schemas import (
    FeedbackAccepted,
    FeedbackBatchAccepted,
    FeedbackBatchRequest,
    FeedbackRequest,
)
from app.services import Services
from ingest.events import FeedbackReceived, utcnow
from ingest.signing import SIGNATURE_HEADER, SignatureError, verify

router = APIRouter(tags=["feedback"])


class _FeedbackIn(FeedbackReceived):
    """A FeedbackRequest validated straight into the wire type: `occurred_at: null` means
    now (as FeedbackRequest allows), and `received_at` is always the server's clock."""

    @field_validator("occurred_at", mode="before")
    @classmethod
    def _null_is_now(cls, value: Any) -> Any:
        return utcnow() if value is None else value

    @field_validator("received_at", mode="before")
    @classmethod
    def _server_clock(cls, _: Any) -> Any:
        return utcnow()


class _FeedbackBatchIn(BaseModel):
    events: list[_FeedbackIn] = Field(min_length=1)


def intake(services: Services) -> FeedbackIntake:
    if services.feedback is None:  # built on first use, here and in tests alike
        services.feedback = FeedbackIntake(
            producer=services.producer, topic=services.kafka.topics.feedback, db=services.db,
            delivery_timeout_s=services.kafka.delivery_timeout_ms / 1000)
    return services.feedback


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes


def _reply(status_code: int, content: object) -> Reply:
    return Reply(status_code, json.dumps(content, separators=(",", ":")).encode())


def _error(error: ApiError, request_id: str | None) -> Reply:
    return Reply(error.status_code, error.encode(request_id))


async def handle(services: Services, body: bytes, signature: str | None, *, batch: bool,
                 request_id: str | None = None) -> Reply:
    """Verify, validate and accept one webhook body; the reply for every outcome."""
    settings = services.settings
    if settings.feedback_secrets:
        secrets = [s.get_secret_value() for s in settings.feedback_secrets]
        try:
            verify(signature, body, secrets, tolerance_s=settings.feedback_tolerance_s)
        except SignatureError as exc:
            return _error(ApiError(status.HTTP_401_UNAUTHORIZED, str(exc),
                                   code="invalid_signature"), request_id)
    try:
        events: Sequence[FeedbackReceived] = (
            _FeedbackBatchIn.model_validate_json(body).events if batch
            else [_FeedbackIn.model_validate_json(body)])
    except ValidationError as exc:
        return _error(validation_error(exc.errors(include_url=False, include_input=False),
                                       status_code=status.HTTP_422_UNPROCESSABLE_CONTENT),
                      request_id)
    if len(events) > settings.feedback_batch_max:
        return _error(ApiError(status.HTTP_413_CONTENT_TOO_LARGE,
                               f"batch of {len(events)} events exceeds "
                               f"{settings.feedback_batch_max}", param="events",
                               code="batch_too_large"), request_id)
    try:
        duplicates = await intake(services).accept(events)
    except FeedbackLogUnavailable as exc:
        return _error(ApiError(status.HTTP_503_SERVICE_UNAVAILABLE,
                               f"feedback log unavailable, retry: {exc}"), request_id)
    repeated = sum(duplicates)
    services.counters.feedback_duplicates += repeated
    services.counters.feedback_accepted += len(events) - repeated
    if not batch:
        return _reply(status.HTTP_202_ACCEPTED,
                      {"event_id": events[0].event_id, "duplicate": duplicates[0]})
    return _reply(status.HTTP_202_ACCEPTED, {
        "accepted": len(events) - repeated, "duplicates": repeated,
        "results": [{"event_id": e.event_id, "duplicate": d}
                    for e, d in zip(events, duplicates, strict=True)]})


async def _respond(request: Request, *, batch: bool) -> Response:
    reply = await handle(request.app.state.services, await request.body(),
                         request.headers.get(SIGNATURE_HEADER), batch=batch,
                         request_id=request_id_of(request))
    return Response(reply.body, reply.status, media_type="application/json")


BODIES = (FeedbackRequest, FeedbackBatchRequest)  # app.main adds them to the components


def _documented(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` describing the JSON body `handle` parses from the raw bytes (it must
    see them unparsed to check the signature), and the signature header."""
    return {"requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}},
            "parameters": [{"name": SIGNATURE_HEADER, "in": "header", "required": False,
                            "schema": {"type": "string"},
                            "description": "t=<unix seconds>,v1=<hex HMAC-SHA256 of "
                                           "'<t>.<body>'>; required when secrets are set"}]}


_ERRORS = error_responses(401, 422, 503)  # + 413, 500: app.main


@router.post("/v1/feedback", status_code=status.HTTP_202_ACCEPTED,
             response_model=FeedbackAccepted, responses=_ERRORS,
             openapi_extra=_documented(FeedbackRequest))
async def post_feedback(request: Request) -> Response:
    return await _respond(request, batch=False)


@router.post("/v1/feedback/batch", status_code=status.HTTP_202_ACCEPTED,
             response_model=FeedbackBatchAccepted, responses=_ERRORS,
             openapi_extra=_documented(FeedbackBatchRequest))
async def post_feedback_batch(request: Request) -> Response:
    return await _respond(request, batch=True)


_BATCH_OF_PATH = {"/v1/feedback": False, "/v1/feedback/batch": True}
_SIGNATURE = SIGNATURE_HEADER.lower().encode("latin-1")
_JSON_HEADERS = [(b"content-type", b"application/json")]


class FeedbackFastPath:
    """ASGI middleware: answers the two webhook routes with `handle` before the app's other
    middleware, exception handlers and router (which cost several times the webhook's own
    work); every other request passes through. Add it just inside `RequestGuard`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        batch = _BATCH_OF_PATH.get(scope["path"]) if scope["type"] == "http" else None
        if batch is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        services: Services = scope["app"].state.services
        headers = dict(scope["headers"])
        body = await _read_body(receive)  # held to max_body_bytes by app/guard.py
        if body is None:  # the client went away
            return
        signature = headers.get(_SIGNATURE)
        reply = await handle(services, body, signature.decode("latin-1")
                             if signature is not None else None, batch=batch,
                             request_id=scope.get("state", {}).get("request_id"))
        await send({"type": "http.response.start", "status": reply.status,
                    "headers": [*_JSON_HEADERS,
                                (b"content-length", str(len(reply.body)).encode())]})
        await send({"type": "http.response.body", "body": reply.body})


async def _read_body(receive: Receive) -> bytes | None:
    """The request body, or None when the client went away."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)
