"""Request and response models of the OpenAI-compatible inference API (`/v1/...`).

Field names, types and defaults follow the OpenAI API, so the official clients work unmodified.
Extras: `session_id` on requests; `generation_id` on each choice (with n > 1 every choice is
its own logged generation; the response `id` is the first one's). Every number is bounded to
what the sampler takes (floats finite, `seed` a signed 64-bit integer), and a request holds at
most `MAX_CHOICES` generations (prompts x n), so no value reaches the engine unchecked.

A field this server does not know is refused (400 naming it), not silently dropped: OpenAI
fields that change nothing here (`store`, `metadata`, ...) are accepted, and those that would
change the output (`logit_bias`, penalties, `response_format`) are accepted only at their
neutral value. Function calling (`tools`, `tool_choice`, `parallel_tool_calls`, assistant
`tool_calls`, `tool` messages) is checked here for shape and in app/api/tool_calls.py against the
conversation and the model's template.
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
    # an unknown field is refused; so is a value of the wrong JSON type (`true` for a number),
    # not coerced, and NaN and the infinities
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

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
    # OpenAI fields that change nothing a reply holds here: accepted and ignored
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # OpenAI fields this server does not implement: only their neutral value is accepted
    frequency_penalty: float | None = Field(default=None, ge=0.0, le=0.0)
    presence_penalty: float | None = Field(default=None, ge=0.0, le=0.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=0)

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names
MAX_TOOLS = 128  # OpenAI's limit


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=TOOL_NAME)
    arguments: str = Field(description="the arguments as a JSON object, encoded as a string")


class ToolCall(BaseModel):
    """A function call the model made: in a reply, and in an assistant message sent back."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="a JSON Schema of an object; absent: no parameters")
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCall] | None = None  # assistant messages only
    tool_call_id: str | None = Field(default=None, max_length=256)  # tool messages only

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
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # only plain text is produced: {"type": "text"} is the one format accepted
    response_format: dict[str, Literal["text"]] | None = None


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
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]
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
