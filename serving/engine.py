"""The `Engine` protocol every inference backend implements, and its request/result types.

An engine generates from token ids (tokenization and chat templates are the caller's) and
returns exactly what was sampled: the completion token ids, each sampled token's logprob under
the distribution it was drawn from (temperature applied; greedy = raw logits), the MoE experts
each position was routed to when the backend can capture them, and the model version.

`stream()` yields `GenerationDelta`s as tokens are sampled; the last one carries the whole
`GenerationResult`. Closing the stream early (a client went away) cancels the generation.
The backends: `serving.torch_engine`, `serving.vllm_engine`; `serving.backends.build_engine`
picks the one `EngineSettings` names.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import AsyncIterator, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

FinishReason = Literal["stop", "length", "cancelled"]
TopLogprobs = list[tuple[int, float]]  # (token_id, logprob) pairs, best first


class EngineError(RuntimeError):
    """A request the engine cannot serve (the message says why)."""


class EngineClosedError(EngineError):
    """The engine was closed while the request waited or ran."""


@dataclass(frozen=True)
class ModelVersion:
    """An immutable set of weights: monotonically increasing number + sha256 of the weights."""

    number: int
    sha256: str

    @property
    def fingerprint(self) -> str:
        return f"fw-v{self.number}-{self.sha256[:12]}"


@dataclass(frozen=True)
class GenerationRequest:
    prompt_token_ids: Sequence[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    stop: Sequence[str] = ()
    top_logprobs: int = 0


@dataclass
class GenerationResult:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    version: ModelVersion
    text: str = ""
    # (T, k) alternatives per position when top_logprobs > 0: (token_id, logprob) pairs.
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # (P + T - 1, moe_layers, top_k) int16, or None when the backend cannot capture routes.
    routed_experts: np.ndarray | None = None


@dataclass
class GenerationDelta:
    """What one engine step added to one generation. `text` never contains a stop string."""

    token_ids: list[int]
    logprobs: list[float]
    text: str = ""
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    result: GenerationResult | None = None  # set on the last delta only


@dataclass(frozen=True)
class SwapTiming:
    """A hot-swap as the engine saw it: admission paused (waiting for in-flight requests, then
    copying) and the in-place copy itself, in seconds."""

    paused_s: float
    copy_s: float


class Engine(Protocol):
    """What the app needs from a backend (torch on CPU, vLLM on GPU)."""

    @property
    def version(self) -> ModelVersion: ...

    @property
    def max_context(self) -> int: ...

    @property
    def tokenizer(self) -> object: ...

    def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]: ...

    async def generate(self, request: GenerationRequest) -> GenerationResult: ...

    def swap_weights(self, commit: Callable[[MutableMapping[str, Any]], object],
                     version: ModelVersion) -> concurrent.futures.Future[SwapTiming]:
        """Between decode steps, once in-flight requests finish, run `commit` (verified
        in-place writes) on the live state dict and serve `version`; resolves when done."""
        ...

    def close(self) -> None: ...


async def collect(deltas: AsyncIterator[GenerationDelta]) -> GenerationResult:
    """Drain a stream and return its final result."""
    async for delta in deltas:
        if delta.result is not None:
            return delta.result
    raise EngineError("generation stream ended without a result")
