"""The `Engine` protocol every inference backend implements, and its request/result types.

An engine generates from token ids (tokenization and chat templates are the caller's) and
returns exactly what was sampled: the completion token ids, each sampled token's logprob under
the distribution it was drawn from (temperature applied; greedy = raw logits), the MoE experts
each position was routed to when the backend can capture them, and the model version.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

FinishReason = Literal["stop", "length", "cancelled"]


class EngineError(RuntimeError):
    """A request the engine cannot serve (the message says why)."""


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
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # (P + T - 1, moe_layers, top_k) int16, or None when the backend cannot capture routes.
    routed_experts: np.ndarray | None = None


class Engine(Protocol):
    """What the app needs from a backend (torch on CPU, vLLM on GPU)."""

    @property
    def version(self) -> ModelVersion: ...

    @property
    def max_context(self) -> int: ...

    async def generate(self, request: GenerationRequest) -> GenerationResult: ...

    def close(self) -> None: ...
