"""`flywheel demo`: start the stack, use it like a product would, show what reached Kafka.

Sends chat completions over HTTP, attaches signed feedback to each generation, reads both topics
back from the broker, checks that every generation and feedback event arrived, and ends with one
JSON line: {"completions": …, "sessions_logged": …, "feedback_logged": …}.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid

import httpx
from pydantic import SecretStr

from app.cli.stack import running_stack
from app.settings import Settings
from ingest.events import FeedbackReceived, GenerationLogged
from ingest.signing import SIGNATURE_HEADER, sign
from ingest.topic_reader import read_all

PROMPTS = [
    "def add(a, b):",
    "Write a function that reverses a string.",
    "def is_even(n):",
    "Return the largest item of a list.",
    "def count_vowels(s):",
    "Complete: for i in range(10):",
]
KINDS = ["accept", "reject", "thumbs_up", "edit_kept"]


def run_demo(settings: Settings, *, completions: int = 4) -> int:
    started = time.perf_counter()
    if not settings.feedback_secrets:  # sign like a product would, with a one-off secret
        settings = settings.model_copy(update={"feedback_secrets": [
            SecretStr(secrets.token_hex(16))]})
    secret = settings.feedback_secrets[0].get_secret_value()
    with running_stack(settings) as stack, httpx.Client(base_url=stack.base_url,
                                                        timeout=120) as http:
        print(f"stack up at {stack.base_url} (kafka {stack.kafka.bootstrap})")
        generation_ids = []
        for i in range(completions):
            prompt = PROMPTS[i % len(PROMPTS)]
            reply = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
                "temperature": 0.8, "seed": i, "user": "demo-user"})
            reply.raise_for_status()
            body = reply.json()
            generation_ids.append(body["id"])
            print(f"[{body['system_fingerprint']}] {prompt!r} -> "
                  f"{body['choices'][0]['message']['content']!r}")
        for i, generation_id in enumerate(generation_ids):
            kind = KINDS[i % len(KINDS)]
            body = json.dumps({
                "event_id": f"evt-{uuid.uuid4().hex}", "generation_id": generation_id,
                "kind": kind, "value": 0.5 if kind == "edit_kept" else None}).encode()
            reply = http.post("/v1/feedback", content=body, headers={
                "content-type": "application/json",
                SIGNATURE_HEADER: sign(secret, None, body)})
            reply.raise_for_status()
        sessions = read_all(stack.kafka, stack.kafka.topics.sessions, GenerationLogged)
        feedback = read_all(stack.kafka, stack.kafka.topics.feedback, FeedbackReceived)
    ours = set(generation_ids)
    sessions_logged = len({s.generation_id for s in sessions} & ours)
    feedback_logged = len({f.generation_id for f in feedback} & ours)
    for event in sessions:
        if event.generation_id in ours:
            print(f"sessions: {event.generation_id} v{event.model_version} "
                  f"prompt={len(event.prompt_token_ids)} tokens "
                  f"completion={len(event.completion_token_ids)} tokens "
                  f"mean logprob={event.logprobs.unpack().mean():.3f} {event.finish_reason}")
    for fb in feedback:
        if fb.generation_id in ours:
            print(f"feedback: {fb.generation_id} {fb.kind} value={fb.value}")
    print(f"demo finished in {time.perf_counter() - started:.1f}s")
    print(json.dumps({"completions": len(generation_ids), "sessions_logged": sessions_logged,
                      "feedback_logged": feedback_logged}))
    return 0 if sessions_logged == feedback_logged == len(generation_ids) else 1
