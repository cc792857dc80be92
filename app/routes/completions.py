"""`POST /v1/chat/completions` and `POST /v1/completions`: OpenAI-compatible, every one logged.

Each choice is one generation: its `generation_id` is logged to `sessions` as
`GenerationLogged` (exact token ids, sampled-token logprobs, routed experts, version) through
the session log, off the request path. The response `id` is the first choice's generation_id,
also in the `X-Flywheel-Generation-Id` header; `X-Flywheel-Generation-Ids` lists all of them
(n > 1 or several prompts) and the choices share one request_id. `system_fingerprint` names
the model version. `stream: true` answers with server-sent events ending in `data: [DONE]`.
A client that goes away cancels its generations (logged with finish_reason "cancelled").
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from app.deps import ServicesDep
from app.errors import ApiError, error_responses, request_id_of
from app.openai_schemas import (
    MAX_CHOICES,
    MAX_STOP,
    MIN_TEMPERATURE,
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from app.services import Services
from app.token_bytes import max_token_bytes, token_bytes, token_text
from ingest.events import GenerationLogged, PackedArray, SamplingParams
from serving.engine import (
    EngineClosedError,
    EngineError,
    GenerationDelta,
    GenerationRequest,
    GenerationResult,
    TopLogprobs,
)

log = logging.getLogger(__name__)
router = APIRouter(tags=["inference"])
GENERATION_HEADER = "X-Flywheel-Generation-Id"
GENERATION_IDS_HEADER = "X-Flywheel-Generation-Ids"
SERVED_MODEL = "flywheel"
Kind = Literal["chat", "completion"]


@dataclass(eq=False)
class Choice:
    """One generation of a request, filled in as its deltas arrive."""

    index: int
    prompt: list[int]
    request: GenerationRequest
    generation_id: str = field(default_factory=lambda: f"gen-{uuid.uuid4().hex}")
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[TopLogprobs] = field(default_factory=list)
    text: str = ""
    result: GenerationResult | None = None
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    def absorb(self, delta: GenerationDelta) -> None:
        if self.first_token_at is None and delta.token_ids:
            self.first_token_at = time.perf_counter()
        self.tokens += delta.token_ids
        self.logprobs += delta.logprobs
        self.tops += delta.top_logprobs
        self.text += delta.text
        if delta.result is not None:
            self.result = delta.result

    @property
    def finish_reason(self) -> Literal["stop", "length"]:
        return "stop" if self.result is not None and self.result.finish_reason == "stop" \
            else "length"


@dataclass
class Plan:
    """A validated request: its choices and what the response and the log need."""

    kind: Kind
    model: str
    choices: list[Choice]
    prompts: list[list[int]]
    sampling: SamplingParams
    logprobs: int | None  # None: no logprobs in the response; else the top-k asked for
    include_usage: bool
    session_id: str | None
    user: str | None
    request_id: str  # the request's X-Request-Id (app/guard.py)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return self.choices[0].generation_id

    def headers(self) -> dict[str, str]:
        return {GENERATION_HEADER: self.id,
                GENERATION_IDS_HEADER: ",".join(c.generation_id for c in self.choices)}

    def fingerprint(self, served: str) -> str:
        """The version that produced the first choice; `served` when it produced nothing."""
        result = self.choices[0].result
        return result.version.fingerprint if result is not None else served

    def usage(self) -> Usage:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.tokens) for c in self.choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion)


# ---- planning: tokenization and limits ---------------------------------------------------
def refuse_unfittable(services: Services, texts: list[str], param: str) -> None:
    """Refuse text that cannot fit the context whatever it tokenizes to (each token covers at
    most `max_token_bytes`) before tokenizing it: near the body limit that would hold the
    event loop for half a second, delaying every other request."""
    size = sum(len(t.encode()) for t in texts)
    least = size // max_token_bytes(services.tokenizer)
    if least >= services.engine.max_context:
        raise ApiError(400, f"This model's maximum context length is "
                       f"{services.engine.max_context} tokens; this prompt of {size} bytes is "
                       f"at least {least} tokens.", param=param, code="context_length_exceeded")


def chat_prompt_ids(tokenizer: Any, messages: list[ChatMessage]) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.text()} for m in messages], tokenize=False,
        add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def completion_prompts(tokenizer: Any, prompt: str | list[str] | list[int] | list[list[int]]
                       ) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    if len(prompt) > MAX_CHOICES:
        raise ApiError(400, f"prompt: at most {MAX_CHOICES} prompts per request",
                       param="prompt")
    out = []
    for p in prompt:
        out.append(list(tokenizer(p, add_special_tokens=False)["input_ids"])
                   if isinstance(p, str) else list(p))  # type: ignore[arg-type]
    return out


def plan(services: Services, kind: Kind, body: ChatCompletionRequest | CompletionRequest,
         prompts: list[list[int]], max_tokens: int | None, logprobs: int | None, *,
         request_id: str | None = None) -> Plan:
    engine, cfg = services.engine, services.settings.engine
    if body.model not in (None, SERVED_MODEL, engine.version.fingerprint):
        raise ApiError(404, f"The model `{body.model}` does not exist; this server serves "
                       f"`{SERVED_MODEL}`", param="model", code="model_not_found")
    if len(prompts) * body.n > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompts x n={body.n} exceeds {MAX_CHOICES} "
                       "generations per request", param="n")
    stop = body.stop_strings()
    if len(stop) > MAX_STOP:
        raise ApiError(400, f"stop: at most {MAX_STOP} sequences", param="stop")
    if max_tokens is not None and max_tokens > cfg.max_new_tokens_cap:
        raise ApiError(400, f"max_tokens {max_tokens} exceeds this server's cap of "
                       f"{cfg.max_new_tokens_cap}", param="max_tokens", code="invalid_value")
    vocab = len(services.tokenizer)  # type: ignore[arg-type]
    longest = max(len(p) for p in prompts)
    for p in prompts:
        if not p:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if any(not 0 <= t < vocab for t in p):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    room = engine.max_context - longest
    if room < 1 or (max_tokens is not None and max_tokens > room):
        asked = max_tokens or 1
        raise ApiError(400, f"This model's maximum context length is {engine.max_context} "
                       f"tokens. However, you requested {longest + asked} tokens "
                       f"({longest} in the prompt, {asked} in the completion).",
                       param="messages" if kind == "chat" else "prompt",
                       code="context_length_exceeded")
    max_tokens = max_tokens or min(cfg.default_max_tokens, room)
    temperature = 1.0 if body.temperature is None else body.temperature
    temperature = 0.0 if temperature < MIN_TEMPERATURE else temperature  # logged as served
    top_p = 1.0 if body.top_p is None else body.top_p
    sampling = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                              seed=body.seed, stop=stop)
    choices = []
    for i in range(len(prompts) * body.n):
        seed = None if body.seed is None else body.seed + i % body.n
        choices.append(Choice(index=i, prompt=prompts[i // body.n], request=GenerationRequest(
            prompt_token_ids=prompts[i // body.n], max_tokens=max_tokens,
            temperature=temperature, top_p=top_p, seed=seed, stop=stop,
            top_logprobs=logprobs or 0)))
    return Plan(kind=kind, model=body.model or SERVED_MODEL, choices=choices, prompts=prompts,
                sampling=sampling, logprobs=logprobs,
                include_usage=bool(body.stream_options and body.stream_options.include_usage),
                session_id=body.session_id, user=body.user,
                request_id=request_id or f"req-{uuid.uuid4().hex}")


# ---- running: all choices of a request at once, each logged exactly once ----------------
async def run_choices(services: Services, p: Plan
                      ) -> AsyncGenerator[tuple[Choice, GenerationDelta], None]:
    """Merge the choices' engine streams; on exit (done, error or cancel) log every choice."""
    events: asyncio.Queue[tuple[Choice, GenerationDelta | Exception | None]] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for delta in services.engine.stream(choice.request):
                await events.put((choice, delta))
        except Exception as exc:  # whatever failed, the request hears of it (never hangs)
            await events.put((choice, exc))
        await events.put((choice, None))

    tasks = [asyncio.create_task(pump(c)) for c in p.choices]
    try:
        running = len(tasks)
        while running:
            choice, item = await events.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                choice.absorb(item)
                yield choice, item
    finally:
        for task in tasks:
            task.cancel()
        for choice in p.choices:
            log_choice(services, p, choice)


def log_choice(services: Services, p: Plan, choice: Choice) -> None:
    result = choice.result
    now = time.perf_counter()
    version = result.version if result is not None else services.engine.version
    routes = result.routed_experts if result is not None else None
    event = GenerationLogged(
        generation_id=choice.generation_id, request_id=p.request_id,
        model_version=version.number, model_sha256=version.sha256,
        session_id=p.session_id, user_id=p.user,
        prompt_token_ids=PackedArray.pack(choice.prompt, "int32"),
        completion_token_ids=PackedArray.pack(choice.tokens, "int32"),
        logprobs=PackedArray.pack(choice.logprobs, "float32"),
        routed_experts=PackedArray.pack(routes, "int16") if routes is not None else None,
        sampling=p.sampling, finish_reason=result.finish_reason if result else "cancelled",
        latency_ms=(now - choice.started) * 1000)
    if services.session_log is not None:
        services.session_log.submit(event)
    else:
        services.producer.send(services.kafka.topics.sessions, choice.generation_id, event)
    services.metrics.observe_generation(
        endpoint=p.kind, prompt_tokens=len(choice.prompt), completion_tokens=len(choice.tokens),
        latency_s=now - choice.started,
        ttft_s=(choice.first_token_at - choice.started) if choice.first_token_at else None,
        finish_reason=event.finish_reason)


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


# ---- response shapes ----------------------------------------------------------------------
def _chat_logprobs(tokenizer: Any, tokens: list[int], logprobs: list[float],
                   tops: list[TopLogprobs]) -> ChoiceLogprobs:
    content = []
    for i, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        text = token_text(tokenizer, token)
        alternatives = [TopLogprob(token=(t := token_text(tokenizer, a)), logprob=alp,
                                   bytes=token_bytes(tokenizer, a, t))
                        for a, alp in (tops[i] if i < len(tops) else [])]
        content.append(TokenLogprob(token=text, logprob=lp,
                                    bytes=token_bytes(tokenizer, token, text),
                                    top_logprobs=alternatives))
    return ChoiceLogprobs(content=content)


def _completion_logprobs(tokenizer: Any, tokens: list[int], logprobs: list[float],
                         tops: list[TopLogprobs], offset: int = 0) -> CompletionLogprobs:
    texts = [token_text(tokenizer, t) for t in tokens]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    top = [{token_text(tokenizer, a): alp for a, alp in (tops[i] if i < len(tops) else [])}
           for i in range(len(tokens))]
    return CompletionLogprobs(tokens=texts, token_logprobs=list(logprobs), top_logprobs=top,
                              text_offset=offsets)


def chat_response(services: Services, p: Plan) -> ChatCompletionResponse:
    tok = services.tokenizer
    return ChatCompletionResponse(
        id=p.id, created=p.created, model=p.model,
        system_fingerprint=p.fingerprint(services.engine.version.fingerprint),
        choices=[ChatChoice(
            index=c.index, message=AssistantMessage(content=c.text),
            logprobs=_chat_logprobs(tok, c.tokens, c.logprobs, c.tops)
            if p.logprobs is not None else None,
            finish_reason=c.finish_reason, generation_id=c.generation_id) for c in p.choices],
        usage=p.usage())


def completion_response(services: Services, p: Plan) -> CompletionResponse:
    tok = services.tokenizer
    return CompletionResponse(
        id=p.id, created=p.created, model=p.model,
        system_fingerprint=p.fingerprint(services.engine.version.fingerprint),
        choices=[CompletionChoice(
            index=c.index, text=c.text,
            logprobs=_completion_logprobs(tok, c.tokens, c.logprobs, c.tops)
            if p.logprobs is not None else None,
            finish_reason=c.finish_reason, generation_id=c.generation_id) for c in p.choices],
        usage=p.usage())


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _chunk(services: Services, p: Plan, choices: list[dict[str, Any]],
           usage: Usage | None = None) -> str:
    body: dict[str, Any] = {
        "id": p.id, "object": "chat.completion.chunk" if p.kind == "chat"
        else "text_completion", "created": p.created, "model": p.model,
        "system_fingerprint": services.engine.version.fingerprint, "choices": choices}
    if usage is not None:
        body["usage"] = usage.model_dump()
    return _sse(body)


def _delta_choice(services: Services, p: Plan, choice: Choice, delta: GenerationDelta
                  ) -> dict[str, Any]:
    tok = services.tokenizer
    finish = choice.finish_reason if delta.result is not None else None
    out: dict[str, Any] = {"index": choice.index, "finish_reason": finish, "logprobs": None}
    if p.kind == "chat":
        out["delta"] = {"content": delta.text} if delta.text or finish is None else {}
        if p.logprobs is not None:
            out["logprobs"] = _chat_logprobs(tok, delta.token_ids, delta.logprobs,
                                             delta.top_logprobs).model_dump()
    else:
        out["text"] = delta.text
        if p.logprobs is not None:
            out["logprobs"] = _completion_logprobs(tok, delta.token_ids, delta.logprobs,
                                                   delta.top_logprobs).model_dump()
    return out


async def sse_events(services: Services, p: Plan) -> AsyncIterator[str]:
    """The SSE body: role chunks (chat), one chunk per delta, usage if asked, [DONE]."""
    if p.kind == "chat":
        yield _chunk(services, p, [{"index": c.index, "delta": {"role": "assistant",
                                                                "content": ""},
                                    "logprobs": None, "finish_reason": None}
                                   for c in p.choices])
    runner = run_choices(services, p)
    try:
        async for choice, delta in runner:
            if delta.token_ids or delta.text or delta.result is not None:
                yield _chunk(services, p, [_delta_choice(services, p, choice, delta)])
    except Exception as exc:  # the status is sent: the error goes in the stream
        log.exception("streamed generation of %s failed", p.request_id)
        yield _sse(ApiError(500, f"generation failed: {exc}").body(p.request_id))
    finally:
        await runner.aclose()
    if p.include_usage:
        yield _chunk(services, p, [], usage=p.usage())
    yield "data: [DONE]\n\n"


async def respond(services: Services, p: Plan, request: Request, response: Response, *,
                  stream: bool) -> ChatCompletionResponse | CompletionResponse | StreamingResponse:
    started = time.perf_counter()
    try:
        if stream:
            return StreamingResponse(sse_events(services, p), media_type="text/event-stream",
                                     headers={**p.headers(), "Cache-Control": "no-cache"})
        await run_to_end(services, p, request)
        response.headers.update(p.headers())
        return chat_response(services, p) if p.kind == "chat" else completion_response(
            services, p)
    finally:
        services.counters.completions += len(p.choices)
        services.metrics.observe_request(p.kind, time.perf_counter() - started)


_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {  # one event of a stream
    "data": {"type": "string", "description": "a JSON chunk (`chat.completion.chunk` or "
                                              "`text_completion`), an error, or `[DONE]`"},
    "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}
_STREAMED = {"content": {"text/event-stream": {"itemSchema": _SSE_EVENT}},
             "description": "JSON, or with `stream: true` server-sent events ending in "
                            "`data: [DONE]`"}
_RESPONSES = {200: _STREAMED, **error_responses(400, 404, 503)}  # + 413, 500: app.main


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses=_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, services: ServicesDep,
                           request: Request, response: Response) -> Any:
    refuse_unfittable(services, [m.text() for m in body.messages], "messages")
    prompt = chat_prompt_ids(services.tokenizer, body.messages)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    p = plan(services, "chat", body, [prompt], body.max_completion_tokens or body.max_tokens,
             logprobs, request_id=request_id_of(request))
    return await respond(services, p, request, response, stream=body.stream)


@router.post("/v1/completions", response_model=CompletionResponse, responses=_RESPONSES)
async def completions(body: CompletionRequest, services: ServicesDep, request: Request,
                      response: Response) -> Any:
    if body.echo:
        raise ApiError(400, "echo is not supported", param="echo")
    for text in [body.prompt] if isinstance(body.prompt, str) else body.prompt:
        if isinstance(text, str):  # each prompt is its own generation: each must fit
            refuse_unfittable(services, [text], "prompt")
    prompts = completion_prompts(services.tokenizer, body.prompt)
    if not prompts:
        raise ApiError(400, "the prompt is empty", param="prompt")
    p = plan(services, "completion", body, prompts, body.max_tokens, body.logprobs,
             request_id=request_id_of(request))
    return await respond(services, p, request, response, stream=body.stream)
