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

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np

if TYPE_CHECKING:
    from kernels.delta.store import ArtifactStore

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
    # an xgrammar structural tag (JSON) the completion must follow: tokens it does not allow
    # are masked before sampling, and the logprob of each sampled token is taken under the
    # masked (renormalized) distribution it was drawn from. The generation stops when the
    # grammar is complete. Used for function calls (app/api/tool_calls.py).
    structural_tag: str | None = None


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
    routes_absent: str | None = None  # why `routed_experts` is None, when the backend knows


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


@dataclass(frozen=True)
class SwapRecord:
    version: int
    sha256: str
    steps: int
    prepare_s: float
    paused_s: float  # admission paused: draining in-flight requests, then the commit
    copy_s: float  # the in-place commit alone
    live_sha256: str  # recomputed from the engine's weights after the swap
    at: float


class Engine(Protocol):
    """What the app needs from a backend (`serving.torch_engine`, `serving.vllm_engine`)."""

    @property
    def version(self) -> ModelVersion: ...

    @property
    def max_context(self) -> int: ...

    @property
    def tokenizer(self) -> object: ...

    def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]: ...

    async def generate(self, request: GenerationRequest) -> GenerationResult: ...

    def swap_to(self, store: ArtifactStore, version: ModelVersion, *,
                timeout_s: float = 120.0) -> SwapRecord:
        """Hot-swap to `version`, read from `store`: verified before any weight is written,
        applied in place once the requests in flight finish (no reply mixes two versions).
        Raises `DeltaError`/`EngineError` with the old weights still served."""
        ...

    def close(self) -> None: ...


def check_request(request: GenerationRequest, max_context: int, *, closed: bool) -> None:
    """What every engine refuses before it queues a request, with the reason."""
    if closed:
        raise EngineClosedError("engine is closed")
    prompt = len(request.prompt_token_ids)
    if not prompt:
        raise EngineError("prompt is empty")
    if request.max_tokens < 1:
        raise EngineError("max_tokens must be at least 1")
    if prompt + request.max_tokens > max_context:
        raise EngineError(f"prompt ({prompt}) + max_tokens ({request.max_tokens}) exceeds the "
                          f"context ({max_context})")


async def collect(deltas: AsyncIterator[GenerationDelta]) -> GenerationResult:
    """Drain a stream and return its final result."""
    async for delta in deltas:
        if delta.result is not None:
            return delta.result
    raise EngineError("generation stream ended without a result")
