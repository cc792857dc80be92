"""The torch backend: continuous batching on one model-owning thread (CPU or one GPU).

All model work runs on one engine thread, so requests never fight over the weights; the
asyncio side submits requests and awaits their deltas. The thread loops: admit waiting
requests, run one batched decode step over every active row (`serving.batching.PaddedKVBatch`),
sample every row at once, each from its own seeded generator (serving/sampling.py), let
finished or cancelled rows leave. For the Qwen3-MoE family the step is serving/decode.py's
lean step, and the requests admitted are prefilled inside it (`mixed`: one pass over the
weights for both); otherwise (other families, batch-invariant mode) they are prefilled first
by the model's own forward (together in one padded forward, or each alone in batch-invariant
mode), then joined. A request's tokens and logprobs therefore do not depend on what else is
in the batch beyond float tolerance (bitwise with `batch_invariant=True`, see
kernels/batch_invariant.py). MoE routes are captured per fed token with kernels/moe_replay.
With `prefix_cache_tokens`, a prompt that starts with a sequence computed recently (the
previous turn of a conversation, the same prompt sampled again) prefills only its new tokens
(serving/prefix_cache.py). A release comes in by `swap_to` (serving/hot_swap.py's
`InPlaceEngine`, which this class is): the thread writes it between two decode steps.

    engine = TorchEngine.load(Path("data/models/base"), max_batch=32)
    result = await engine.generate(GenerationRequest(prompt_token_ids=[...], max_tokens=32))
    async for delta in engine.stream(request): ...
"""

from __future__ import annotations

import contextlib
import logging
import queue
import random
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import torch

from kernels.weights import checkpoint_dtype, state_dict_sha256
from serving import hot_swap
from serving.batching import cache_kv, joined_row_kv, prefill_inputs
from serving.config import default_threads, on_own_thread
from serving.decode import Joining, decode, lean_decoder
from serving.engine import (
    EngineClosedError,
    EngineError,
    GenerationDelta,
    GenerationRequest,
    GenerationResult,
    ModelVersion,
    check_request,
    collect,
)
from serving.grammar import Grammars
from serving.onednn import OneDnnMode
from serving.prefix_cache import PrefixCache, PrefixHit, repeat_waves
from serving.sampling import sample_rows
from serving.sequence import DecodingRows, EngineSequence

log = logging.getLogger(__name__)


class TorchEngine(hot_swap.InPlaceEngine):
    """Generates with a transformers model; `version` names the weights it serves."""

    def __init__(self, model: Any, tokenizer: Any, *, version_number: int = 0, seed: int = 0,
                 max_batch: int = 32, batch_invariant: bool = False,
                 prefix_cache_tokens: int = 0, compile: bool = False,
                 onednn: OneDnnMode = "auto") -> None:
        if batch_invariant and prefix_cache_tokens:
            raise ValueError("prefix caching reuses keys/values from other forward passes, so "
                             "it cannot be bitwise batch-invariant: choose one")
        self.model = model.eval()
        self._bitwise = batch_invariant  # prefill each request alone
        if batch_invariant:
            from kernels.batch_invariant import enable_batch_invariant

            enable_batch_invariant(self.model)
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self._version = ModelVersion(version_number, state_dict_sha256(model.state_dict()))
        self._rng = random.Random(seed)
        self._eos_ids = frozenset(i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id)
                                  if i is not None)
        self._grammars = Grammars(tokenizer, int(model.config.vocab_size), self._eos_ids)
        self._inbox: queue.SimpleQueue[EngineSequence | None] = queue.SimpleQueue()
        self._rows = DecodingRows()
        self._joining: list[EngineSequence] = []  # prefilled with the next step (lean step)
        self._deferred: list[EngineSequence] = []  # admitted, to join with a later step
        self.between = hot_swap.BetweenSteps(wake=lambda: self._inbox.put(None))
        self._decoder = lean_decoder(self.model, batch_invariant=batch_invariant,
                                     onednn=onednn)
        self._compile = compile and self._decoder is not None
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        self._weights_epoch = 0  # bumped by every call or swap that may change the weights
        self.prefilled_tokens = 0  # prompt tokens fed through the model (cached ones are not)
        self._closed, self._started = threading.Event(), threading.Event()
        self.on_step: Callable[[int], None] | None = None  # called with the decode batch size
        self.threads = 0  # torch intra-op threads of the engine thread, read when it starts
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        self._started.wait()  # the step compiled (on the thread that runs it), if asked

    @classmethod
    def load(cls, model_dir: Path, *, version_number: int = 0, seed: int = 0,
             threads: int | None = None, max_batch: int = 32,
             batch_invariant: bool = False, prefix_cache_tokens: int = 0,
             compile: bool = False, onednn: OneDnnMode = "auto") -> TorchEngine:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if not (model_dir / "config.json").exists():
            raise EngineError(f"no Hugging Face model in {model_dir} (run `flywheel init-model`)")

        def build() -> TorchEngine:
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            model = AutoModelForCausalLM.from_pretrained(model_dir,
                                                         dtype=checkpoint_dtype(model_dir))
            if n := threads or default_threads(model):
                torch.set_num_threads(n)
            return cls(model, tokenizer, version_number=version_number, seed=seed,
                       max_batch=max_batch, batch_invariant=batch_invariant,
                       prefix_cache_tokens=prefix_cache_tokens, compile=compile,
                       onednn=onednn)
        return on_own_thread(build)  # keeps the caller's thread free of torch's OpenMP pool

    @property
    def version(self) -> ModelVersion:
        return self._version

    @property
    def max_context(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @property
    def active(self) -> int:
        return len(self._rows)

    # ---- asyncio side -------------------------------------------------------------------
    def _open(self, request: GenerationRequest, *, want_deltas: bool) -> EngineSequence:
        check_request(request, self.max_context, closed=self._closed.is_set())
        seed = request.seed if request.seed is not None else self._rng.getrandbits(63)
        grammar = self._grammars.open(request.structural_tag) \
            if request.structural_tag is not None else None
        seq = EngineSequence.open(request, self.tokenizer, seed=seed, eos_ids=self._eos_ids,
                                  want_deltas=want_deltas, grammar=grammar)
        self._inbox.put(seq)
        return seq

    def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """Deltas as tokens are sampled; closing the iterator early cancels the generation."""
        return self._open(request, want_deltas=True).deltas()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await collect(self._open(request, want_deltas=False).deltas())

    def set_version(self, version: ModelVersion) -> None:
        self._version = version

    def decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def close(self) -> None:
        self._closed.set()
        self._inbox.put(None)
        self._thread.join(timeout=30)

    # ---- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        from kernels.moe_replay import capture_routes, find_routers

        self.threads = torch.get_num_threads()
        if self._compile:
            self._decoder.compile()  # type: ignore[union-attr]
        self._started.set()
        capture = (capture_routes(self.model) if find_routers(self.model)
                   else contextlib.nullcontext())  # no top-k MoE routers: recorder None
        with torch.inference_mode(), capture as recorder:
            while not self._closed.is_set():
                self.between.run_calls(self.model, self._weights_changed)
                if not self._swap_when_drained():
                    self._admit(recorder)
                self._rows.drop_cancelled(self._version)
                if self._joining:
                    self._mixed_step(recorder)
                elif self._rows:
                    self._decode_step(recorder)
        self._rows.fail(EngineClosedError("engine closed"))
        self._fail_waiting(EngineClosedError("engine closed"))

    def _swap_when_drained(self) -> bool:
        """True while a swap waits for the rows in flight to finish (admission paused)."""
        if not self.between.swap_waiting():
            return False
        if self._rows:
            return True
        self.between.commit_swap(self.model.state_dict(), self._serve)
        return False

    def _serve(self, version: ModelVersion) -> None:
        """Swapped in: the weights are `version`'s from now on."""
        self._weights_changed()
        self._version = version

    def _admit(self, recorder: Any) -> None:
        """Take waiting requests up to `max_batch`. With the lean step, the first wave joins
        with the next step (`_mixed_step`) and a second (prompt repeats) waits for one after
        it; otherwise each wave is prefilled now, on its own."""
        joining, self._deferred = self._deferred, []
        block = not self._rows and not joining
        while len(self._rows) + len(joining) < self.max_batch:
            try:
                seq = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
            except queue.Empty:
                break
            block = False
            if seq is None:
                break
            joining.append(seq)
        for seq in joining:
            if seq.cancelled:
                seq.finish("cancelled", self._version)
        waves = self._waves([seq for seq in joining if not seq.cancelled])
        if self._decoder is not None and waves:
            self._joining, self._deferred = waves[0], [s for wave in waves[1:] for s in wave]
            return
        for wave in waves:
            self._prefill_wave(wave, recorder)

    def _waves(self, joining: list[EngineSequence]) -> list[list[EngineSequence]]:
        """With a prefix cache, repeats of a prompt wait for its first copy's prefill."""
        if self.prefix_cache is None:
            return [joining]
        return [[joining[i] for i in wave]
                for wave in repeat_waves([seq.request.prompt_token_ids for seq in joining])]

    def _prefill_wave(self, wave: list[EngineSequence], recorder: Any) -> None:
        if len(wave) > 1 and not self._bitwise:
            try:  # one forward for every request that arrived since the last step
                self._prefill(wave, recorder)
                return
            except Exception:  # e.g. out of memory: try them one by one
                log.exception("batched prefill failed; prefilling one request at a time")
        for seq in wave:  # alone: bitwise the same whatever else is waiting
            try:
                self._prefill([seq], recorder)
            except Exception as exc:  # its forward failed; the batch goes on
                log.exception("prefill failed")
                seq.send(EngineError(f"prefill failed: {exc}"))

    def _weights_changed(self) -> None:
        self._weights_epoch += 1
        if self._decoder is not None:
            self._decoder.weights_changed()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def _prefill(self, seqs: list[EngineSequence], recorder: Any) -> None:
        """Feed `seqs`' prompts, past any cached prefix, in one forward (rows padded as in
        `serving.batching.prefill_inputs`), sample every row's first token in one call, and each
        row not finished by it joins the decode batch. Raises only if the forward or the
        sampling fails (nothing joined)."""
        prompts, hits = self._lookup(seqs)
        inputs = prefill_inputs(prompts, hits)
        out = self.model(**inputs, use_cache=True, logits_to_keep=1)
        routes = recorder.pop_step().routes if recorder is not None else None  # (B, N, L, K)
        tokens, chosen, dists = sample_rows(out.logits[:, -1], [seq.sampling for seq in seqs])
        joining: list[tuple[EngineSequence, Any, int]] = []
        for b, (seq, prompt, hit) in enumerate(zip(seqs, prompts, hits, strict=True)):
            try:
                row = (cache_kv(out.past_key_values) if len(seqs) == 1
                       else joined_row_kv(out.past_key_values, b, inputs))
                if self._first_token(seq, prompt, hit, None if routes is None else routes[b],
                                     row, (tokens[b], chosen[b], dists[b])):
                    joining.append((seq, row, len(prompt)))
            except Exception as exc:  # this request fails; the others join
                log.exception("prefill failed")
                seq.send(EngineError(f"prefill failed: {exc}"))
        self._rows.join(joining)

    def _lookup(self, seqs: list[EngineSequence]) -> tuple[list[list[int]],
                                                            list[PrefixHit | None]]:
        """Each request's prompt, and its longest cached prefix (None: none, or no cache)."""
        prompts = [list(seq.request.prompt_token_ids) for seq in seqs]
        return prompts, [self.prefix_cache.lookup(p) if self.prefix_cache is not None else None
                         for p in prompts]

    def _first_token(self, seq: EngineSequence, prompt: list[int], hit: PrefixHit | None,
                     routes: torch.Tensor | None, row: Any,
                     sampled: tuple[int, float, torch.Tensor]) -> bool:
        """A prefilled request: count the tokens fed past its cached prefix (`hit`), record
        their experts (the last of `routes`, (n, L, K), after the prefix's), cache its
        keys/values (`row`, per layer (1, H, P, D) over the prompt), take its first token
        (`sampled`); True unless that finished it."""
        new = len(prompt) - (hit.length if hit is not None else 0)
        self.prefilled_tokens += new
        if routes is not None:
            fed = routes[len(routes) - new:]
            seq.routes.append(fed if hit is None or hit.routes is None
                              else torch.cat([hit.routes, fed]))
        seq.weights_epoch = self._weights_epoch
        if self.prefix_cache is not None:
            self.prefix_cache.insert(prompt, row, torch.cat(seq.routes) if seq.routes else None)
        return not seq.accept(*sampled, self._version)

    def _decode_step(self, recorder: Any) -> None:
        rows = self._rows
        if self.on_step is not None:
            self.on_step(len(rows))
        try:
            logits, routes = decode(self.model, self._decoder, rows.kv,
                                    [s.tokens[-1] for s in rows.seqs], recorder)  # (B, L, K)
        except Exception as exc:  # every row in the step fails; the engine goes on
            log.exception("decode step failed")
            rows.fail(EngineError(f"decode step failed: {exc}"))
            return
        rows.kv.advance()
        sampled = sample_rows(logits, [seq.sampling for seq in rows.seqs])
        rows.keep(rows.accept(routes, sampled, self._version, self._cache_finished))

    def _mixed_step(self, recorder: Any) -> None:
        """A decode step of the batch's rows that also prefills the joining requests (the
        lean step's `mixed`): their first tokens are sampled with the rows' next ones, and the
        unfinished join the batch. If it fails, the joining requests are prefilled on their
        own (the model's forward, one by one if need be) and the rows decode as usual."""
        rows, joining, self._joining = self._rows, self._joining, []
        prompts, hits = self._lookup(joining)
        try:
            step = self._decoder.mixed(  # type: ignore[union-attr]
                [s.tokens[-1] for s in rows.seqs], rows.kv,
                [Joining(p[hit.length:], hit.kv) if hit is not None else Joining(p)
                 for p, hit in zip(prompts, hits, strict=True)])
            sampled = sample_rows(step.logits, [seq.sampling for seq in rows.seqs + joining])
        except Exception:
            log.exception("a step with prefills failed; prefilling them on their own")
            self._prefill_wave(joining, recorder)
            if self._rows:
                self._decode_step(recorder)
            return
        if rows:
            rows.kv.advance()
            if self.on_step is not None:
                self.on_step(len(rows))
        keep = rows.accept(step.routes, sampled, self._version, self._cache_finished)
        tokens, chosen, dists = sampled
        joined: list[tuple[EngineSequence, Any, int]] = []
        for i, (seq, prompt, hit) in enumerate(zip(joining, prompts, hits, strict=True)):
            b, row = len(rows) + i, step.joined_kv[i]
            if self._first_token(seq, prompt, hit, step.joined_routes[i], row,
                                 (tokens[b], chosen[b], dists[b])):
                joined.append((seq, row, len(prompt)))
        rows.keep(keep)
        rows.join(joined)

    def _cache_finished(self, seq: EngineSequence, row: int) -> None:
        """Keep a finished row's keys/values: its prompt and every sampled token but the last
        (never fed), which the next turn of its conversation starts with."""
        if self.prefix_cache is None or seq.weights_epoch != self._weights_epoch:
            return
        fed = list(seq.request.prompt_token_ids) + seq.tokens[:-1]
        self.prefix_cache.insert(fed, self._rows.kv.row_kv(row),
                                 torch.cat(seq.routes) if seq.routes else None)

    def _fail_waiting(self, exc: Exception) -> None:
        for admitted in self._joining + self._deferred:
            admitted.send(exc)
        self._joining, self._deferred = [], []
        while True:
            try:
                seq = self._inbox.get_nowait()
            except queue.Empty:
                return
            if seq is not None:
                seq.send(exc)
