"""`POST /v1/chat/completions`: OpenAI-compatible chat completions, every one logged.

The response `id` is the generation_id (also in the `X-Flywheel-Generation-Id` header) that
the product attaches feedback to; `system_fingerprint` names the model version that produced
it. The exact token ids and logprobs go to the `sessions` topic as `GenerationLogged`.
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, HTTPException, Response, status

from app.deps import ServicesDep
from app.schemas import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    Usage,
)
from app.services import Services
from ingest.events import GenerationLogged, PackedArray, SamplingParams
from serving.engine import EngineError, GenerationRequest, GenerationResult

router = APIRouter(tags=["inference"])
GENERATION_HEADER = "X-Flywheel-Generation-Id"


def chat_prompt_ids(tokenizer: object, messages: list[ChatMessage]) -> list[int]:
    text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [m.model_dump() for m in messages], tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]


def log_generation(services: Services, *, generation_id: str, prompt: list[int],
                   result: GenerationResult, sampling: SamplingParams, latency_ms: float,
                   session_id: str | None, user_id: str | None) -> None:
    event = GenerationLogged(
        generation_id=generation_id, request_id=generation_id,
        model_version=result.version.number, model_sha256=result.version.sha256,
        session_id=session_id, user_id=user_id,
        prompt_token_ids=PackedArray.pack(prompt, "int32"),
        completion_token_ids=PackedArray.pack(result.token_ids, "int32"),
        logprobs=PackedArray.pack(result.logprobs, "float32"),
        routed_experts=(PackedArray.pack(result.routed_experts, "int16")
                        if result.routed_experts is not None else None),
        sampling=sampling, finish_reason=result.finish_reason, latency_ms=latency_ms)
    services.producer.send(services.kafka.topics.sessions, generation_id, event)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def chat_completions(body: ChatCompletionRequest, services: ServicesDep,
                           response: Response) -> ChatCompletionResponse:
    engine_cfg = services.settings.engine
    max_tokens = body.max_tokens or engine_cfg.default_max_tokens
    if max_tokens > engine_cfg.max_new_tokens_cap:
        raise HTTPException(status.HTTP_400_BAD_REQUEST,
                            f"max_tokens {max_tokens} exceeds the cap "
                            f"{engine_cfg.max_new_tokens_cap}")
    prompt = chat_prompt_ids(services.tokenizer, body.messages)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    sampling = SamplingParams(temperature=body.temperature, top_p=body.top_p,
                              max_tokens=max_tokens, seed=body.seed, stop=stop)
    started = time.perf_counter()
    try:
        result = await services.engine.generate(GenerationRequest(
            prompt_token_ids=prompt, max_tokens=max_tokens, temperature=body.temperature,
            top_p=body.top_p, seed=body.seed, stop=stop))
    except EngineError as exc:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, str(exc)) from exc
    latency_ms = (time.perf_counter() - started) * 1000
    generation_id = f"gen-{uuid.uuid4().hex}"
    log_generation(services, generation_id=generation_id, prompt=prompt, result=result,
                   sampling=sampling, latency_ms=latency_ms, session_id=body.session_id,
                   user_id=body.user)
    services.counters.completions += 1
    response.headers[GENERATION_HEADER] = generation_id
    return ChatCompletionResponse(
        id=generation_id, created=int(time.time()), model=body.model or "flywheel",
        system_fingerprint=result.version.fingerprint,
        choices=[ChatChoice(index=0, message=ChatMessage(role="assistant", content=result.text),
                            finish_reason="stop" if result.finish_reason == "stop" else "length")],
        usage=Usage(prompt_tokens=len(prompt), completion_tokens=len(result.token_ids),
                    total_tokens=len(prompt) + len(result.token_ids)))
