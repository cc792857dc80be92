"""Request and response models of the OpenAI-compatible inference API (`/v1/...`).

Field names, types and defaults follow the OpenAI API, so the official clients work unmodified.
Extras: `session_id` on requests; `generation_id` on each choice (with n > 1 every choice is
its own logged generation; the response `id` is the first one's). Every number is bounded to
what the sampler takes (floats finite, `seed` a signed 64-bit integer), and a request holds at
most `MAX_CHOICES` generations (prompts x n), so no value reaches the engine unchecked.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16  # choices per prompt; each is a batch row
MAX_CHOICES = 64  # generations per request (prompts x n)
MAX_STOP = 4  # stop strings per request (OpenAI's limit)
INT64 = (-(2**63), 2**63 - 1)
# below this a temperature samples greedily, as 0 does (its limit); logits / T would overflow
# float32 near 1e-36 and make the distribution NaN
MIN_TEMPERATURE = 1e-6


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class _SamplingFields(BaseModel):
    # OpenAI clients send fields we ignore; a value of the wrong JSON type (`true` for a
    # number) is refused, not coerced, and so are NaN and the infinities
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=INT64[0], le=INT64[1])
    user: str | None = Field(default=None, max_length=256)
    session_id: str | None = Field(default=None, max_length=256)

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text parts are supported
            return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description=f"a prompt, or up to {MAX_CHOICES} of them (text or token ids)")
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"]
    generation_id: str


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"]
    generation_id: str


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flywheel"
    version: int
    system_fingerprint: str
    max_context: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
