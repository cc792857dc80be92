"""`POST /v1/chat/completions` and `POST /v1/completions`: OpenAI-compatible, every one logged.

Each choice is one generation: its `generation_id` is logged to `sessions` as
`GenerationLogged` (exact token ids, sampled-token logprobs, routed experts, version) through
the session log, off the request path. The response `id` is the first choice's generation_id,
also in the `X-Flywheel-Generation-Id` header; `X-Flywheel-Generation-Ids` lists all of them
(n > 1 or several prompts) and the choices share one request_id. `system_fingerprint` names
the model version. `stream: true` answers with server-sent events ending in `data: [DONE]`.
A client that goes away cancels its generations (logged with finish_reason "cancelled").

A request is checked and tokenized into its generations by app/api/completion_plan.py and run
(and logged) by app/api/completion_run.py; this module shapes the replies as OpenAI does: JSON once
every choice is done, or server-sent events as tokens are sampled.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from app.api.completion_plan import (
    Choice,
    Plan,
    chat_prompt_ids,
    completion_prompts,
    plan,
    refuse_unfittable,
)
from app.api.completion_run import run_choices, run_to_end
from app.api.deps import CallerDep, ServicesDep
from app.api.errors import ApiError, error_responses, request_id_of
from app.api.openai_schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from app.api.services import Services
from app.api.token_bytes import token_bytes, token_text
from app.api.tool_calls import (
    check_messages,
    content_of,
    template_renders_tools,
    tool_call_dicts,
    tool_plan,
)
from serving.engine import GenerationDelta, TopLogprobs
from serving.tool_parsers import CallEvent

log = logging.getLogger(__name__)
router = APIRouter(tags=["inference"])


# ---- reply shapes -------------------------------------------------------------------------
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


def _message(choice: Choice) -> AssistantMessage:
    if choice.calls is None:
        return AssistantMessage(content=choice.text)
    calls = tool_call_dicts(choice.calls.calls)
    return AssistantMessage.model_validate({"content": content_of(choice.calls),
                                            "tool_calls": calls or None})


def chat_response(services: Services, p: Plan) -> ChatCompletionResponse:
    tok = services.tokenizer
    return ChatCompletionResponse(
        id=p.id, created=p.created, model=p.model,
        system_fingerprint=p.fingerprint(p.engine.version.fingerprint),
        choices=[ChatChoice(
            index=c.index, message=_message(c),
            logprobs=_chat_logprobs(tok, c.tokens, c.logprobs, c.tops)
            if p.logprobs is not None else None,
            finish_reason=c.finish_reason, generation_id=c.generation_id) for c in p.choices],
        usage=p.usage())


def completion_response(services: Services, p: Plan) -> CompletionResponse:
    tok = services.tokenizer
    return CompletionResponse(
        id=p.id, created=p.created, model=p.model,
        system_fingerprint=p.fingerprint(p.engine.version.fingerprint),
        choices=[CompletionChoice(
            index=c.index, text=c.text,
            logprobs=_completion_logprobs(tok, c.tokens, c.logprobs, c.tops)
            if p.logprobs is not None else None,
            finish_reason="length" if c.finish_reason == "length" else "stop",  # no tools here
            generation_id=c.generation_id) for c in p.choices],
        usage=p.usage())


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _chunk(services: Services, p: Plan, choices: list[dict[str, Any]],
           usage: Usage | None = None) -> str:
    body: dict[str, Any] = {
        "id": p.id, "object": "chat.completion.chunk" if p.kind == "chat"
        else "text_completion", "created": p.created, "model": p.model,
        "system_fingerprint": p.engine.version.fingerprint, "choices": choices}
    if usage is not None:
        body["usage"] = usage.model_dump()
    return _sse(body)


def _call_deltas(event: CallEvent) -> list[dict[str, Any]]:
    """A completed call as OpenAI streams one: index, id and name once, then the arguments in
    pieces."""
    head = {"index": event.index, "id": event.id, "type": "function",
            "function": {"name": event.call.name, "arguments": ""}}
    return [{"tool_calls": [head]}] + [
        {"tool_calls": [{"index": event.index, "function": {"arguments": piece}}]}
        for piece in event.call.argument_pieces()]


def _delta_choices(services: Services, p: Plan, choice: Choice, delta: GenerationDelta,
                   events: list[str | CallEvent]) -> list[dict[str, Any]]:
    """The chunks' choices for one engine delta: its content (and logprobs), then any call
    it completed, the last one carrying the finish reason."""
    tok = services.tokenizer
    finish: str | None = choice.finish_reason if delta.result is not None else None
    if p.kind != "chat":
        out: dict[str, Any] = {"index": choice.index, "text": delta.text,
                               "finish_reason": finish, "logprobs": None}
        if p.logprobs is not None:
            out["logprobs"] = _completion_logprobs(tok, delta.token_ids, delta.logprobs,
                                                   delta.top_logprobs).model_dump()
        return [out]
    text = "".join(e for e in events if isinstance(e, str))
    first: dict[str, Any] = {"content": text} if text else {}
    deltas = [first]
    for event in events:
        if isinstance(event, CallEvent):
            deltas += _call_deltas(event)
    if p.logprobs is None and not first and len(deltas) > 1:
        deltas = deltas[1:]  # nothing in the first: the calls' chunks carry it
    chunks: list[dict[str, Any]] = [
        {"index": choice.index, "delta": d, "logprobs": None, "finish_reason": None}
        for d in deltas]
    if p.logprobs is not None:
        chunks[0]["logprobs"] = _chat_logprobs(tok, delta.token_ids, delta.logprobs,
                                               delta.top_logprobs).model_dump()
    chunks[-1]["finish_reason"] = finish
    return chunks


async def sse_events(services: Services, p: Plan) -> AsyncIterator[str]:
    """The SSE body: role chunks (chat), the chunks of each delta, usage if asked, [DONE]."""
    if p.kind == "chat":
        yield _chunk(services, p, [{"index": c.index, "delta": {"role": "assistant",
                                                                "content": ""},
                                    "logprobs": None, "finish_reason": None}
                                   for c in p.choices])
    runner = run_choices(services, p)
    try:
        async for choice, delta, events in runner:
            if not (delta.token_ids or delta.text or delta.result is not None):
                continue
            for piece in _delta_choices(services, p, choice, delta, events):
                if piece.get("delta") == {} and piece["finish_reason"] is None \
                        and piece["logprobs"] is None:
                    continue  # text held back (it may begin a call): nothing to say yet
                yield _chunk(services, p, [piece])
    except Exception as exc:  # the status is sent: the error goes in the stream
        log.exception("streamed generation of %s failed", p.request_id)
        yield _sse(ApiError(500, f"generation failed: {exc}").body(p.request_id))
    finally:
        await runner.aclose()
    if p.include_usage:
        yield _chunk(services, p, [], usage=p.usage())
    yield "data: [DONE]\n\n"


# ---- routes ------------------------------------------------------------------------------
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
_RESPONSES = {200: _STREAMED, **error_responses(400, 401, 404, 429, 503)}  # + 413, 500


PRIVACY_HEADER = "X-Flywheel-Privacy"
_PRIVACY = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}


def privacy_asked(request: Request) -> bool:
    """Whether the request asks for privacy mode (`X-Flywheel-Privacy: on`); any caller may,
    and a key made `private` always does (a request cannot turn that off)."""
    value = request.headers.get(PRIVACY_HEADER)
    if value is None:
        return False
    asked = _PRIVACY.get(value.strip().lower())
    if asked is None:
        raise ApiError(400, f"{PRIVACY_HEADER} must be on or off, not {value!r}",
                       param=PRIVACY_HEADER, code="invalid_value")
    return asked


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses=_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, services: ServicesDep,
                           caller: CallerDep, request: Request, response: Response) -> Any:
    texts = [m.text() for m in body.messages]
    refuse_unfittable(services, texts + [json.dumps([t.model_dump() for t in body.tools or []])],
                      "messages")
    messages = check_messages(body.messages)
    tools = tool_plan(body, services.settings.engine.tool_parser)
    if tools is not None and not template_renders_tools(services.tokenizer):
        raise ApiError(400, "this model's chat template does not render tools, so the model "
                       "would never see them", param="tools")
    prompt = chat_prompt_ids(services.tokenizer, messages, tools.tools if tools else None)
    if tools is not None and len(prompt) >= services.engine.max_context:
        raise ApiError(400, f"the tools and messages take {len(prompt)} tokens, past this "
                       f"model's maximum context length of {services.engine.max_context}",
                       param="tools", code="context_length_exceeded")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    p = plan(services, "chat", body, [prompt], body.max_completion_tokens or body.max_tokens,
             logprobs, request_id=request_id_of(request), tools=tools, caller=caller,
             private=privacy_asked(request))
    return await respond(services, p, request, response, stream=body.stream)


@router.post("/v1/completions", response_model=CompletionResponse, responses=_RESPONSES)
async def completions(body: CompletionRequest, services: ServicesDep, caller: CallerDep,
                      request: Request, response: Response) -> Any:
    if body.echo:
        raise ApiError(400, "echo is not supported", param="echo")
    for text in [body.prompt] if isinstance(body.prompt, str) else body.prompt:
        if isinstance(text, str):  # each prompt is its own generation: each must fit
            refuse_unfittable(services, [text], "prompt")
    prompts = completion_prompts(services.tokenizer, body.prompt)
    if not prompts:
        raise ApiError(400, "the prompt is empty", param="prompt")
    p = plan(services, "completion", body, prompts, body.max_tokens, body.logprobs,
             request_id=request_id_of(request), caller=caller, private=privacy_asked(request))
    return await respond(services, p, request, response, stream=body.stream)
