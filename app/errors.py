"""Errors of the OpenAI-compatible routes, in OpenAI's shape.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": "context_length_exceeded"}}

Routes raise `OpenAIError`; request validation on the `/v1` inference routes answers 400 in the
same shape (OpenAI's status for a bad parameter). Other routes keep FastAPI's `detail` shape.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          503: "server_error"}


class OpenAIError(Exception):
    """An error a `/v1` route answers with; `type` defaults from the status code."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status_code, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status_code, content=self.body())


async def _openai_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    return exc.response()


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    if not request.url.path.startswith(OPENAI_PATHS):
        return await request_validation_exception_handler(request, exc)
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return OpenAIError(400, message, param=param, code="invalid_value").response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
