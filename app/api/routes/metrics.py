"""`GET /metrics`: Prometheus text format (requests, tokens, latency, batch size, log queue)."""

from __future__ import annotations

from fastapi import APIRouter, Response

from app.api.deps import ServicesDep
from app.api.metrics import CONTENT_TYPE

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response, responses={200: {
    "description": "Prometheus text exposition format",
    "content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(services: ServicesDep) -> Response:
    return Response(services.metrics.render(), media_type=CONTENT_TYPE)
