"""A simulated user population: editor-like prompts over HTTP, signed feedback by a hidden taste.

Each user sends chat completions to the OpenAI-compatible endpoint, judges the completion by a
hidden preference (accept or reject), flips the judgment with probability `noise`, waits a
random delay (people react late), and posts the verdict to the signed feedback webhook
(`ingest/signing.py`). The population records, per served model version (`system_fingerprint`),
how many completions it accepted: the live acceptance rate the demo plots.

The default preference: the completion starts with one of a hidden set of token strings. The
set is the base model's tokens whose (tied) embeddings point most along one random direction,
so the taste is one direction in the model's own representation: rare under the base model
(|set| / vocab), and learnable from a few hundred events by a tiny model on a CPU.

    population = UserPopulation(base_url, preference=aligned_prefix_preference(model_dir))
    stats = population.run(requests=400, concurrency=4)
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx

from ingest.signing import SIGNATURE_HEADER, sign

EDITOR_PROMPTS = [
    "def add(a, b):", "Complete: for i in range(10):", "def is_even(n):",
    "Write a function that reverses a string.", "def count_vowels(s):",
    "Return the largest item of a list.", "class Stack:", "import json\n\ndef load(path):",
    "def fizzbuzz(n):", "# sort the list in place\n", "def parse_args(argv):",
    "Fix the bug: return x +", "def mean(values):", "try:\n    value = int(text)\nexcept",
]


class Preference(Protocol):
    def accepts(self, completion: str) -> bool: ...


@dataclass(frozen=True)
class StartsWith:
    """Accepts completions that begin with one of `prefixes` (after no stripping)."""

    prefixes: tuple[str, ...]

    def accepts(self, completion: str) -> bool:
        return completion.startswith(self.prefixes)


def aligned_prefix_preference(model_dir: Path, *, size: int = 160, seed: int = 7
                              ) -> StartsWith:
    """The `size` tokens most aligned with a random direction of the base model's embeddings.

    Decoded strings that are empty, pure whitespace or special are left out (an editor would
    not notice them); the base rate is roughly size / vocab.
    """
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    emb = next(t for n, t in weights.items() if n.endswith("embed_tokens.weight"))  # (V, H)
    direction = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(seed))
    scores = (emb.float() / emb.float().norm(dim=1, keepdim=True)) @ direction
    special = set(tok.all_special_ids)
    prefixes: list[str] = []
    for token_id in scores.argsort(descending=True).tolist():
        text = str(tok.decode([token_id]))
        if token_id in special or not text.strip() or "\ufffd" in text:
            continue
        prefixes.append(text)
        if len(prefixes) == size:
            break
    return StartsWith(tuple(prefixes))


@dataclass
class VersionStats:
    served: int = 0
    accepted: int = 0  # by the hidden preference, before noise: the true acceptance

    @property
    def rate(self) -> float:
        return self.accepted / self.served if self.served else 0.0


@dataclass
class PopulationStats:
    by_version: dict[str, VersionStats] = field(default_factory=lambda: defaultdict(VersionStats))
    failed_requests: int = 0
    feedback_sent: int = 0
    feedback_failed: int = 0

    def acceptance(self) -> dict[str, float]:
        return {v: round(s.rate, 4) for v, s in self.by_version.items()}


class UserPopulation:
    """Many users over one HTTP client pool; `run` blocks until all feedback is delivered."""

    def __init__(self, base_url: str, *, preference: Preference, secret: str | None = None,
                 prompts: Sequence[str] = EDITOR_PROMPTS, noise: float = 0.05,
                 max_delay_s: float = 0.5, max_tokens: int = 8, temperature: float = 1.0,
                 seed: int = 0) -> None:
        self.base_url, self.preference, self.secret = base_url, preference, secret
        self.prompts, self.noise, self.max_delay_s = list(prompts), noise, max_delay_s
        self.max_tokens, self.temperature = max_tokens, temperature
        self.rng = random.Random(seed)
        self.stats = PopulationStats()
        self.log: list[dict[str, object]] = []  # one row per completion, in order
        self._lock = threading.Lock()
        self._http = httpx.Client(base_url=base_url, timeout=120)

    def run(self, *, requests: int, concurrency: int = 4,
            stop: threading.Event | None = None) -> PopulationStats:
        with ThreadPoolExecutor(concurrency, thread_name_prefix="user") as pool:
            for done in [pool.submit(self.one_session, i) for i in range(requests)]:
                if stop is not None and stop.is_set():
                    break
                done.result()
        return self.stats

    def one_session(self, index: int) -> None:
        with self._lock:
            prompt = self.rng.choice(self.prompts)
            flip = self.rng.random() < self.noise
            delay = self.rng.uniform(0, self.max_delay_s)
        try:
            reply = self._http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": self.max_tokens, "temperature": self.temperature,
                "user": f"sim-{index % 50}"})
            reply.raise_for_status()
        except httpx.HTTPError:
            with self._lock:
                self.stats.failed_requests += 1
            return
        body = reply.json()
        text = body["choices"][0]["message"]["content"]
        liked = self.preference.accepts(text)
        version = str(body["system_fingerprint"])
        with self._lock:
            stats = self.stats.by_version[version]
            stats.served += 1
            stats.accepted += liked
            self.log.append({"t": time.time(), "version": version, "accepted": liked})
        time.sleep(delay)
        self.send_feedback(body["id"], "accept" if liked != flip else "reject")

    def send_feedback(self, generation_id: str, kind: str) -> None:
        body = json.dumps({"event_id": f"sim-{uuid.uuid4().hex}",
                           "generation_id": generation_id, "kind": kind,
                           "source": "simulated-user"}).encode()
        headers = {"content-type": "application/json"}
        if self.secret is not None:
            headers[SIGNATURE_HEADER] = sign(self.secret, None, body)
        try:
            self._http.post("/v1/feedback", content=body, headers=headers).raise_for_status()
            ok = True
        except httpx.HTTPError:
            ok = False
        with self._lock:
            if ok:
                self.stats.feedback_sent += 1
            else:
                self.stats.feedback_failed += 1

    def close(self) -> None:
        self._http.close()
