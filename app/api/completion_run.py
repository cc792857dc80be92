"""A plan's generations, run on the engine all at once and each logged to `sessions` exactly
once, as `GenerationLogged` through the session log, whatever ends them: done, an engine
error, or the client going away (finish_reason "cancelled")."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

from fastapi import Request

from app.api.completion_plan import Choice, Plan
from app.api.errors import ApiError
from app.api.services import Services
from ingest.events import GenerationLogged, PackedArray, ToolUse
from serving.engine import EngineClosedError, EngineError, GenerationDelta
from serving.tool_parsers import CallEvent, CallParser

Step = tuple[Choice, GenerationDelta, list[str | CallEvent]]


async def run_choices(services: Services, p: Plan) -> AsyncGenerator[Step, None]:
    """Merge the choices' engine streams: each delta with the content and calls it completed.
    On exit (done, error or cancel) log every choice."""
    events: asyncio.Queue[tuple[Choice, GenerationDelta | Exception | None]] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for delta in p.engine.stream(choice.request):
                await events.put((choice, delta))
        except Exception as exc:  # whatever failed, the request hears of it (never hangs)
            await events.put((choice, exc))
        await events.put((choice, None))

    # a canary engine is closed only once no request is in flight on it, and a request
    # planned on a canary closed since runs where its session is served now (serving/canary.py)
    with services.versions.serving(p.engine, p.session_id) as engine:
        p.engine = engine
        tasks = [asyncio.create_task(pump(c)) for c in p.choices]
        try:
            with services.live.request():  # a scavenging rollout worker yields while any is
                running = len(tasks)
                while running:
                    choice, item = await events.get()
                    if item is None:
                        running -= 1
                    elif isinstance(item, Exception):
                        raise item
                    else:
                        yield choice, item, choice.absorb(item)
        finally:
            for task in tasks:
                task.cancel()
            for choice in p.choices:
                log_choice(services, p, choice)


def log_choice(services: Services, p: Plan, choice: Choice) -> None:
    """Log `choice` to `sessions` (a private one is only counted) and to the metrics."""
    result = choice.result
    now = time.perf_counter()
    version = result.version if result is not None else p.engine.version
    services.metrics.observe_generation(
        endpoint=p.kind, prompt_tokens=len(choice.prompt), completion_tokens=len(choice.tokens),
        latency_s=now - choice.started,
        ttft_s=(choice.first_token_at - choice.started) if choice.first_token_at else None,
        finish_reason=result.finish_reason if result else "cancelled")
    if choice.calls is not None and choice.calls.invalid:
        services.metrics.invalid_tool_calls.labels(model_version=str(version.number)).inc(
            len(choice.calls.invalid))
    if p.private:
        services.metrics.private_generations.labels(p.kind).inc()
        return
    routes = result.routed_experts if result is not None else None
    event = GenerationLogged(
        generation_id=choice.generation_id, request_id=p.request_id,
        model_version=version.number, model_sha256=version.sha256,
        session_id=p.session_id, user_id=p.user,
        prompt_token_ids=PackedArray.pack(choice.prompt, "int32"),
        completion_token_ids=PackedArray.pack(choice.tokens, "int32"),
        logprobs=PackedArray.pack(choice.logprobs, "float32"),
        routed_experts=PackedArray.pack(routes, "int16") if routes is not None else None,
        routes_absent=result.routes_absent if result is not None and routes is None else None,
        sampling=p.sampling, finish_reason=result.finish_reason if result else "cancelled",
        latency_ms=(now - choice.started) * 1000, tool_use=tool_use(choice.calls))
    if services.session_log is not None:
        services.session_log.submit(event)
    else:
        services.producer.send(services.kafka.topics.sessions, choice.generation_id, event)


def tool_use(calls: CallParser | None) -> ToolUse | None:
    """The log's summary of a generation's calls (None: no tools offered)."""
    if calls is None:
        return None
    asked = not calls.calls and calls.content.rstrip().endswith("?")
    return ToolUse(calls=len(calls.calls), invalid=len(calls.invalid), question=asked)


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_to_end(services: Services, p: Plan, request: Request) -> None:
    """Run every choice to its end; a client disconnect cancels them all."""
    async def consume() -> None:
        async for _ in run_choices(services, p):
            pass

    work = asyncio.create_task(consume())
    gone = asyncio.create_task(_until_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
    if work.cancelled():
        raise ApiError(499, "client closed the request", code="client_closed")
    exc = work.exception()
    if isinstance(exc, EngineClosedError):
        raise ApiError(503, f"the engine is shutting down: {exc}")
    if isinstance(exc, EngineError):
        raise ApiError(500, f"generation failed: {exc}")
    if exc is not None:
        raise exc
