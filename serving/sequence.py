"""One request of the torch engine (serving/torch_engine.py): on the engine thread, what it
has sampled and how it samples its next token (its own seeded generator, whatever its batch);
on the asyncio side, its deltas, the last carrying the whole `GenerationResult`. A consumer
that stops reading them cancels it: the engine drops it before the next step.
`DecodingRows` are the requests decoding together, beside their keys/values."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from serving.batching import PaddedKVBatch, compact_order
from serving.detokenize import TextTracker
from serving.engine import (
    FinishReason,
    GenerationDelta,
    GenerationRequest,
    GenerationResult,
    ModelVersion,
    TopLogprobs,
)
from serving.grammar import TokenGrammar
from serving.sampling import RowSampling, top_alternatives


@dataclass(eq=False)
class EngineSequence:
    """One request on the engine thread, plus the way back to its asyncio consumer."""

    request: GenerationRequest
    generator: torch.Generator
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[GenerationDelta | Exception]
    text: TextTracker
    stop_ids: frozenset[int]
    want_deltas: bool
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[TopLogprobs] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)  # each (n, L, K) int16
    cancelled: bool = False
    weights_epoch: int = 0  # the engine's weights when prefilled: cache its KV only if current
    grammar: TokenGrammar | None = None  # the request's structural tag, when it has one

    @classmethod
    def open(cls, request: GenerationRequest, tokenizer: Any, *, seed: int,
             eos_ids: frozenset[int], want_deltas: bool,
             grammar: TokenGrammar | None = None) -> EngineSequence:
        """A sequence whose deltas go to the running event loop."""
        return cls(request=request, generator=torch.Generator().manual_seed(seed),
                   loop=asyncio.get_running_loop(), out=asyncio.Queue(),
                   text=TextTracker(tokenizer, request.stop, incremental=want_deltas),
                   stop_ids=eos_ids | frozenset(request.stop_token_ids),
                   want_deltas=want_deltas, grammar=grammar)

    async def deltas(self) -> AsyncIterator[GenerationDelta]:
        """Its deltas up to the last (or its error); closing this early cancels it."""
        try:
            while True:
                item = await self.out.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.result is not None:
                    return
        finally:
            self.cancelled = True  # a no-op once finished; otherwise the row leaves next step

    # ---- on the engine thread -----------------------------------------------------------
    def send(self, item: GenerationDelta | Exception) -> None:
        with contextlib.suppress(RuntimeError):  # the consumer's loop is closed: nobody waits
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)

    @property
    def sampling(self) -> RowSampling:
        return RowSampling(self.request.temperature, self.request.top_p, self.generator,
                           self.grammar)

    def accept(self, token: int, logprob: float, logprobs: torch.Tensor,
               version: ModelVersion) -> bool:
        """Take the token sampled for it (`serving.sampling.sample_rows`, `logprobs` (V,) the
        distribution it came from); True when that finished the sequence."""
        req = self.request
        tops = top_alternatives(logprobs, req.top_logprobs)
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if req.top_logprobs:
            self.tops.append(tops)
        text = self.text.push(token)
        if self.grammar is not None:
            self.grammar.accept(token)
        finish: FinishReason | None = None
        if token in self.stop_ids or self.text.stopped or (
                self.grammar is not None and self.grammar.done):
            finish = "stop"
        elif len(self.tokens) >= req.max_tokens:
            finish = "length"
        if finish is not None:
            self.finish(finish, version, text=text, token=(token, logprob, tops))
            return True
        if self.want_deltas:
            self.send(GenerationDelta(token_ids=[token], logprobs=[logprob], text=text,
                                      top_logprobs=[tops] if req.top_logprobs else []))
        return False

    def finish(self, reason: FinishReason, version: ModelVersion, *, text: str = "",
               token: tuple[int, float, TopLogprobs] | None = None) -> None:
        """Send the last delta (with `token`, the one that finished it, if any) and the
        result, generated by `version`."""
        text += self.text.finish()
        # (P + T - 1, L, K): one row per position fed through the model
        routes = torch.cat(self.routes).numpy().astype(np.int16) if self.routes else None
        result = GenerationResult(
            token_ids=list(self.tokens), logprobs=list(self.logprobs), finish_reason=reason,
            version=version, text=self.text.text, top_logprobs=list(self.tops),
            routed_experts=routes)
        tok, lp, tops = token if token is not None else (None, None, [])
        self.send(GenerationDelta(
            token_ids=[tok] if tok is not None else [], logprobs=[lp] if lp is not None else [],
            text=text, top_logprobs=[tops] if tok is not None and self.request.top_logprobs
            else [], finish_reason=reason, result=result))


class DecodingRows:
    """The requests decoding together: row b of `seqs` is row b of `kv`, their keys/values
    (serving/batching.py), joined, sampled, kept and failed together."""

    def __init__(self) -> None:
        self.seqs: list[EngineSequence] = []
        self.kv = PaddedKVBatch()

    def __len__(self) -> int:
        return len(self.seqs)

    def join(self, joined: Sequence[tuple[EngineSequence, Any, int]]) -> None:
        """Prefilled requests join the batch: (request, its keys/values, prompt length)."""
        self.seqs += [seq for seq, _, _ in joined]
        self.kv.extend([(row, length) for _, row, length in joined])

    def accept(self, routes: torch.Tensor | None,
               sampled: tuple[list[int], list[float], torch.Tensor], version: ModelVersion,
               finished: Callable[[EngineSequence, int], None]) -> list[int]:
        """Hand each row its sampled token (and routes (B, L, K)); `finished(seq, row)` for
        each row that token finished; the indices of the others."""
        tokens, chosen, dists = sampled
        keep = []
        for b, seq in enumerate(self.seqs):
            if routes is not None:
                seq.routes.append(routes[b:b + 1])
            if not seq.accept(tokens[b], chosen[b], dists[b], version):
                keep.append(b)
            else:
                finished(seq, b)
        return keep

    def keep(self, keep: list[int]) -> None:
        """Keep the rows `keep` (increasing), reordered so the batch's store moves fewest."""
        keep = compact_order(keep)
        self.seqs = [self.seqs[b] for b in keep]
        self.kv.keep(keep)

    def drop_cancelled(self, version: ModelVersion) -> None:
        keep = [b for b, seq in enumerate(self.seqs) if not seq.cancelled]
        if len(keep) == len(self.seqs):
            return
        for seq in self.seqs:
            if seq.cancelled:
                seq.finish("cancelled", version)
        self.keep(keep)

    def fail(self, exc: Exception) -> None:
        """Every row gets `exc`; the batch is empty after."""
        for seq in self.seqs:
            seq.send(exc)
        self.seqs, self.kv = [], PaddedKVBatch()
