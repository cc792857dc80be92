"""`RequestGuard`: the outermost ASGI middleware, around every request.

- gives the request an id, `req-<hex>`, in `request.state.request_id` and the `X-Request-Id`
  response header (the completion routes log their generations under the same id);
- holds the body to `max_body_bytes` *while it streams in*: a declared `Content-Length` over
  the limit is refused before anything is read, and a chunked body is cut the moment it
  crosses the limit (413), so an oversized upload is never read whole nor tokenized;
- answers an exception nothing else handled with a JSON 500 carrying the id, and logs the
  traceback under the same id.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.errors import ApiError, BodyTooLarge

log = logging.getLogger(__name__)
REQUEST_ID_HEADER = b"x-request-id"


class RequestGuard:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int,
                 on_oversized: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.limit = max_body_bytes
        self.on_oversized = on_oversized  # told the path of a body refused by its declared size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (REQUEST_ID_HEADER, request_id.encode())]}
            await send(message)

        async def refuse(error: ApiError) -> None:
            await send_with_id({"type": "http.response.start", "status": error.status_code,
                                "headers": [(b"content-type", b"application/json")]})
            await send_with_id({"type": "http.response.body",
                                "body": error.encode(request_id)})

        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await refuse(BodyTooLarge(self.limit, declared=int(declared)).error())
            if self.on_oversized is not None:
                self.on_oversized(scope["path"])
            return
        received = 0

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        try:
            await self.app(scope, receive_limited, send_with_id)
        except BodyTooLarge as exc:  # raised where no route handled it (a plain ASGI reader)
            if not started:
                await refuse(exc.error())
        except Exception:
            log.exception("request %s %s failed (request_id %s)", scope["method"],
                          scope["path"], request_id)
            if not started:
                await refuse(ApiError(500, f"internal error; request_id {request_id} is in "
                                      "the server log", code="internal_error"))
