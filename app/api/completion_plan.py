"""A completion request checked and tokenized into a `Plan` before any engine work: one
`Choice` per generation (prompts x `n`), each with its own seed, and the sampling as served
and logged. What can be refused is refused here, in OpenAI's words (an unknown model, a prompt
that cannot fit the context, judged from its size before it is tokenized, `max_tokens` over
the server's cap)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from app.api.api_keys import Caller
from app.api.errors import ApiError
from app.api.openai_schemas import (
    MAX_CHOICES,
    MAX_STOP,
    MIN_TEMPERATURE,
    ChatCompletionRequest,
    CompletionRequest,
    Usage,
)
from app.api.services import Services
from app.api.token_bytes import max_token_bytes
from app.api.tool_calls import ToolPlan
from ingest.events import PRIVATE_GENERATION_PREFIX, SamplingParams
from serving.engine import (
    Engine,
    GenerationDelta,
    GenerationRequest,
    GenerationResult,
    TopLogprobs,
)
from serving.tool_parsers import CallEvent, CallParser

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
    generation_id: str  # new_generation_id()
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[TopLogprobs] = field(default_factory=list)
    text: str = ""
    result: GenerationResult | None = None
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    calls: CallParser | None = None  # with tools: the text split into content and calls

    def absorb(self, delta: GenerationDelta) -> list[str | CallEvent]:
        """Take one delta; returns what it adds to the reply: content and completed calls."""
        if self.first_token_at is None and delta.token_ids:
            self.first_token_at = time.perf_counter()
        self.tokens += delta.token_ids
        self.logprobs += delta.logprobs
        self.tops += delta.top_logprobs
        self.text += delta.text
        if delta.result is not None:
            self.result = delta.result
        if self.calls is None:
            return [delta.text] if delta.text else []
        events = self.calls.feed(delta.text)
        return events + self.calls.finish() if delta.result is not None else events

    @property
    def finish_reason(self) -> Literal["stop", "length", "tool_calls"]:
        if self.result is None or self.result.finish_reason != "stop":
            return "length"
        return "tool_calls" if self.calls is not None and self.calls.calls else "stop"


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
    request_id: str  # the request's X-Request-Id (app/api/guard.py)
    engine: Engine  # the session's version's (serving/canary.py): every choice runs there
    private: bool = False  # privacy mode: served and counted, nothing of it logged
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


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
    """`messages` (app.api.tool_calls.check_messages) through the model's chat template."""
    text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
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


def new_generation_id(private: bool) -> str:
    """A generation's id: `gen-…`, or `genp-…` in privacy mode (the webhook refuses by it)."""
    return f"{PRIVATE_GENERATION_PREFIX if private else 'gen-'}{uuid.uuid4().hex}"


def plan(services: Services, kind: Kind, body: ChatCompletionRequest | CompletionRequest,
         prompts: list[list[int]], max_tokens: int | None, logprobs: int | None, *,
         request_id: str | None = None, tools: ToolPlan | None = None,
         caller: Caller | None = None, private: bool = False) -> Plan:
    """The generations of one request; `caller`: the inference key's, whose user id is the
    logged one (the body's `user` is only where keys are off); `private`: privacy mode (the
    request asked, or its key always does), each generation id `genp-…`."""
    private = private or (caller is not None and caller.private)
    engine, cfg = services.versions.engine_for(body.session_id), services.settings.engine
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
        choices.append(Choice(index=i, prompt=prompts[i // body.n],
                              generation_id=new_generation_id(private), calls=tools.parser()
                              if tools is not None else None, request=GenerationRequest(
            prompt_token_ids=prompts[i // body.n], max_tokens=max_tokens,
            temperature=temperature, top_p=top_p, seed=seed, stop=stop,
            top_logprobs=logprobs or 0,
            structural_tag=tools.structural_tag if tools is not None else None)))
    return Plan(kind=kind, model=body.model or SERVED_MODEL, choices=choices, prompts=prompts,
                sampling=sampling, logprobs=logprobs,
                include_usage=bool(body.stream_options and body.stream_options.include_usage),
                session_id=body.session_id,
                user=caller.user_id if caller is not None else body.user,
                request_id=request_id or f"req-{uuid.uuid4().hex}", engine=engine,
                private=private)
