"""The multi-turn agent loop: the model calls tools, tools answer, until it finishes.

A conversation is ChatML built token by token (never re-tokenized), so the ids the trainer
sees are exactly the ids the engine saw and sampled:

    <|im_start|>system\n{tool instructions}<|im_end|>\n
    <|im_start|>user\n{task prompt}<|im_end|>\n
    <|im_start|>assistant\n{tool call}<|im_end|>\n      <- model tokens: loss mask 1
    <|im_start|>tool\n{observation}<|im_end|>\n          <- environment: loss mask 0
    <|im_start|>assistant\n ...                          up to `max_turns` model turns

Self-summarization: when the context passes `context_budget` tokens, the harness asks the
model to summarize its progress; the summary is sampled (and trained) like any model turn, then
a fresh context starts from the system prompt, the task and that summary. Each context window
is one `Segment`; a trajectory is the list of its segments, all sharing the episode's reward.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from serving.engine import Engine, GenerationRequest, GenerationResult

SUMMARIZE_PROMPT = "Context is full. Summarize your progress so far in a few lines."
SUMMARY_PREFIX = "Summary of your earlier progress:\n"


class ToolEnvironment(Protocol):
    """One episode's world: turns model text into an observation, and scores the end state."""

    def system_prompt(self) -> str: ...

    def task_prompt(self) -> str: ...

    def step(self, text: str) -> tuple[str, bool]:
        """Run the tool call in `text`; return (observation, episode done)."""
        ...

    def reward(self) -> float: ...


@dataclass(frozen=True)
class HarnessConfig:
    max_turns: int = 4
    max_tokens: int = 64  # per model turn
    temperature: float = 1.0
    top_p: float = 1.0
    context_budget: int = 1024  # tokens in one context before self-summarization
    max_summaries: int = 2


@dataclass
class Segment:
    """One context window. All lists have the length of `token_ids`; logprobs are 0 where the
    mask is 0. `routes` (rows, layers, k): the experts of the window's first `rows` positions
    as the engine routed them in its last call (later untrained tokens have none)."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routes: np.ndarray | None = None

    def extend(self, ids: list[int], *, model: bool = False,
               logprobs: list[float] | None = None) -> None:
        self.token_ids += ids
        self.loss_mask += [int(model)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class Trajectory:
    task_id: str
    segments: list[Segment]
    policy_version: int
    reward: float = 0.0
    turns: int = 0
    summaries: int = 0
    finished: bool = False
    texts: list[str] = field(default_factory=list)  # the model's turns, decoded

    @property
    def model_tokens(self) -> int:
        return sum(sum(s.loss_mask) for s in self.segments)


class ChatTokens:
    """ChatML pieces as token ids for one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.im_start = int(tokenizer.convert_tokens_to_ids("<|im_start|>"))
        self.im_end = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        self.newline = self.encode("\n")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def open(self, role: str) -> list[int]:
        return [self.im_start, *self.encode(f"{role}\n")]

    def turn(self, role: str, content: str) -> list[int]:
        return [*self.open(role), *self.encode(content), self.im_end, *self.newline]

    def prompt(self, system: str, user: str, *extra_user: str) -> list[int]:
        ids = self.turn("system", system) + self.turn("user", user)
        for text in extra_user:
            ids += self.turn("user", text)
        return ids + self.open("assistant")


class Harness:
    """Runs episodes of one `Engine` against `ToolEnvironment`s."""

    def __init__(self, engine: Engine, chat: ChatTokens, config: HarnessConfig) -> None:
        self.engine = engine
        self.chat = chat
        self.config = config

    async def run(self, env: ToolEnvironment, *, task_id: str, seed: int | None = None,
                  policy_version: int | None = None) -> Trajectory:
        version = policy_version if policy_version is not None else self.engine.version.number
        segment = Segment()
        segment.extend(self.chat.prompt(env.system_prompt(), env.task_prompt()))
        traj = Trajectory(task_id=task_id, segments=[segment], policy_version=version)
        for turn in range(self.config.max_turns):
            if len(segment) > self.config.context_budget \
                    and traj.summaries < self.config.max_summaries:
                segment = await self._summarize(env, traj, seed=_turn_seed(seed, turn, 1))
            text = await self._model_turn(segment, seed=_turn_seed(seed, turn, 0))
            traj.texts.append(text)
            traj.turns += 1
            # tools may run the sandbox (a child process): off the loop, so that the other
            # episodes of the batch keep decoding meanwhile
            observation, done = await asyncio.to_thread(env.step, text)
            if done:
                traj.finished = True
                break
            segment.extend(self.chat.turn("tool", observation) + self.chat.open("assistant"))
        traj.reward = await asyncio.to_thread(env.reward)
        return traj

    async def _model_turn(self, segment: Segment, *, seed: int | None) -> str:
        """Sample one assistant turn into `segment` (which ends with the assistant header)."""
        budget = self.engine.max_context - len(segment)
        result = await self.engine.generate(GenerationRequest(
            prompt_token_ids=list(segment.token_ids), max_tokens=min(self.config.max_tokens,
                                                                     max(1, budget)),
            temperature=self.config.temperature, top_p=self.config.top_p, seed=seed,
            stop_token_ids=(self.chat.im_end,)))
        self._append_model(segment, result)
        return self.chat.decode([t for t in result.token_ids if t != self.chat.im_end])

    def _append_model(self, segment: Segment, result: GenerationResult) -> None:
        segment.extend(list(result.token_ids), model=True, logprobs=list(result.logprobs))
        if result.routed_experts is not None:
            segment.routes = result.routed_experts  # covers the segment up to this turn
        if not result.token_ids or result.token_ids[-1] != self.chat.im_end:
            segment.extend([self.chat.im_end])  # cut at max_tokens: close the turn, untrained
        segment.extend(self.chat.newline)

    async def _summarize(self, env: ToolEnvironment, traj: Trajectory, *,
                         seed: int | None) -> Segment:
        """Ask for a summary in the full context, then restart the context from it."""
        segment = traj.segments[-1]
        segment.extend(self.chat.turn("user", SUMMARIZE_PROMPT) + self.chat.open("assistant"))
        summary = await self._model_turn(segment, seed=seed)
        traj.summaries += 1
        fresh = Segment()
        fresh.extend(self.chat.prompt(env.system_prompt(), env.task_prompt(),
                                      SUMMARY_PREFIX + summary))
        traj.segments.append(fresh)
        return fresh


def _turn_seed(seed: int | None, turn: int, kind: int) -> int | None:
    return None if seed is None else (seed * 1009 + turn * 2 + kind) % 2**62
