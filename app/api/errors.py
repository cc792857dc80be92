"""Every error the API answers, in one shape (OpenAI's, which the `/v1` clients already read):

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": "context_length_exceeded", "request_id": "req-..."}}

`request_id` is the request's `X-Request-Id` (app/api/guard.py); a 500 is logged with it. Routes
raise `ApiError` (or FastAPI's `HTTPException`, answered in the same shape). A body that does
not validate is 400 on the inference routes (OpenAI's status) and 422 on the feedback and
admin routes (FastAPI's, which webhook senders and admin clients expect); `param` names the
first bad field. Routes document their error statuses with `error_responses`, so
`/openapi.json` lists every status a route gives and the body that comes with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          503: "server_error"}
_DESCRIPTIONS = {
    400: "A parameter is invalid (OpenAI's status for a bad request)",
    401: "Missing or wrong credentials (inference key, admin bearer token, webhook "
         "signature)",
    404: "No such resource", 409: "Conflicts with the resource's state",
    413: "The body, or a batch in it, exceeds the configured limit",
    429: "Over the inference key's request rate: retry after `Retry-After` seconds",
    422: "The body does not validate: `param` names the first bad field",
    500: "Failed on the server: quote `request_id`, which the server log carries",
    503: "Temporarily unavailable (shutting down, the broker unreachable): retry"}


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    request_id: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error answer."""

    error: ErrorBody


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route: each status it can answer, with the error body."""
    return {s: {"model": ErrorResponse, "description": _DESCRIPTIONS[s]} for s in statuses}


class ApiError(Exception):
    """An error a route answers with; `type` defaults from the status code."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status_code, "invalid_request_error")
        self.headers = headers

    def body(self, request_id: str | None = None) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code, "request_id": request_id}}

    def encode(self, request_id: str | None = None) -> bytes:
        return json.dumps(self.body(request_id), separators=(",", ":")).encode()

    def response(self, request_id: str | None = None) -> JSONResponse:
        return JSONResponse(status_code=self.status_code, content=self.body(request_id),
                            headers=self.headers)


class BodyTooLarge(StarletteHTTPException):
    """The body crossed `max_body_bytes` (app/api/guard.py raises it from `receive`). An
    HTTPException, so FastAPI's body parsing lets it through to the handlers here (it turns
    any other exception into a 400 "error parsing the body")."""

    def __init__(self, limit: int, *, declared: int | None = None) -> None:
        size = f"of {declared} bytes " if declared is not None else ""
        super().__init__(413, f"the request body {size}exceeds the limit of {limit} bytes")

    def error(self) -> ApiError:
        return ApiError(413, str(self.detail), code="request_too_large")


def request_id_of(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


def validation_error(errors: list[Any], *, status_code: int) -> ApiError:
    """The first of pydantic's `errors()` as an ApiError naming the field (`body.` dropped)."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":  # FastAPI's loc: ("body", character offset)
        return ApiError(status_code, f"the body is not JSON: {first.get('ctx', {}).get('error')} "
                        f"at character {first['loc'][-1]}", code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid request"))
    return ApiError(status_code, f"{param}: {message}" if param else message, param=param,
                    code="invalid_value")


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response(request_id_of(request))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if isinstance(exc, BodyTooLarge):
        return exc.error().response(request_id_of(request))
    return ApiError(exc.status_code, str(exc.detail), headers=exc.headers).response(
        request_id_of(request))


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    inference = request.url.path.startswith(INFERENCE_PATHS)
    return validation_error(list(exc.errors()), status_code=400 if inference else 422
                            ).response(request_id_of(request))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
