"""The multi-turn agent loop: the model calls tools, tools answer, until it finishes.

The loop is one piece of code for every way of reaching a model, through `ModelTurns`: open a
context window with the tools, add turns that are not the model's (tool results, a user's
nudge), sample the model's turn and get its tool calls. Two backends:

- `EngineTurns` (this module): token ids on an `Engine` in this process, what the bootstrap's
  rollouts train on. A window is the model's chat template built token by token, exactly as
  the server renders it (the first prompt through the template itself, then each piece in
  the template's words), and the model's turns are the ids it sampled, never re-tokenized:

    <|im_start|>system\n{system prompt}\n\n# Tools ... <tools>...</tools> ...<|im_end|>\n
    <|im_start|>user\n{task prompt}<|im_end|>\n
    <|im_start|>assistant\n<tool_call>...</tool_call><|im_end|>\n   <- sampled: loss mask 1
    <|im_start|>user\n<tool_response>\n{observation}\n</tool_response>\n<|im_end|>\n
    <|im_start|>assistant\n ...                           up to `max_turns` model turns

  Its calls are parsed from the sampled text by the parser the server uses.
- `simulate.developers.ChatTurns`: OpenAI function calling against a Flywheel endpoint with
  the official client, one chat completion per model turn, as an editor's agent calls it (the
  server logs the tokens it served).

A turn without a call gets a user message asking for one. Self-summarization: when the
context passes `context_budget` tokens, the harness asks the model to summarize its progress;
the summary is sampled (and trained) like any model turn, then a fresh context starts from
the system prompt, the task and that summary (at most `max_summaries` times). The baseline it
is measured against (`overflow="truncate"`, bench/horizon.py) drops the oldest turns instead:
the fresh context opens with the newest `KEEP_RESULTS` calls and results as they were. A
task may set its own turn limit (`ToolEnvironment.max_turns`: the long tasks'). Each context
window is one segment; a trajectory is the list of its segments, all sharing the episode's
reward. A window with no room for another turn (`ContextFull`) ends the episode, scored as it
stands, with `ended_by = "context"`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

import numpy as np

from ingest.rollout_events import RolloutSampling
from serving.engine import Engine, GenerationRequest, GenerationResult
from serving.tool_parsers import FORMATS, CallParser, parse_text
from simulate.rewards import Reward
from simulate.tools import DEFAULT_FORMAT, ToolCall

SUMMARIZE_PROMPT = "Context is full. Summarize your progress so far in a few lines."
SUMMARY_PREFIX = "Summary of your earlier progress:\n"
KEEP_RESULTS = 2  # calls (with their results) the truncation baseline carries over
NO_CALL = "error: no tool call. Call one of the tools."
TRUNCATED_PREFIX = "Earlier turns were dropped. Your last calls and their results:\n"
Overflow = Literal["summarize", "truncate"]


class ToolEnvironment(Protocol):
    """One episode's world: runs the model's tool calls, and scores the end state."""

    def system_prompt(self) -> str: ...

    def task_prompt(self) -> str: ...

    def max_turns(self) -> int | None:
        """The task's own turn limit (a long task's), or None: the harness's."""
        ...

    def tools(self) -> list[dict[str, Any]]:
        """The tools it offers, as OpenAI function tools."""
        ...

    def step(self, calls: list[ToolCall]) -> tuple[list[str], bool]:
        """Run the calls in order; return an observation per call run and whether the
        episode is done (calls after the one that ended it are not run)."""
        ...

    def reward(self) -> Reward:
        """The final state's reward, with the anti-cheat flags that zeroed it if any."""
        ...


@dataclass(frozen=True)
class HarnessConfig:
    max_turns: int = 4
    max_tokens: int = 64  # per model turn
    temperature: float = 1.0
    top_p: float = 1.0
    context_budget: int = 1024  # tokens in one context before self-summarization
    max_summaries: int = 2
    # what a context past the budget becomes: "summarize" (the model's summary of its work
    # opens a fresh one) or "truncate" (the baseline: the oldest turns dropped, the fresh one
    # opening with the newest results as they were)
    overflow: Overflow = "summarize"

    @classmethod
    def of(cls, sampling: RolloutSampling) -> HarnessConfig:
        """The harness a rollout job's sampling describes."""
        return cls(max_turns=sampling.max_turns, max_tokens=sampling.max_tokens,
                   temperature=sampling.temperature, context_budget=sampling.context_budget,
                   max_summaries=sampling.max_summaries, overflow=sampling.overflow)


@dataclass(frozen=True)
class ModelTurn:
    """What the model said in one turn: all of it as text, and the calls in it."""

    text: str
    calls: list[ToolCall]


@dataclass(frozen=True)
class Sampling:
    """How one model turn is sampled."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None


W = TypeVar("W")
EndedBy = Literal["finished", "turns", "context"]


class ContextFull(Exception):
    """A model's window has no room for another turn: the episode ends there, by its context
    (`Trajectory.ended_by`), scored on the workspace as it stands."""


class ModelTurns(Protocol[W]):
    """How the harness reaches a model; `W` is the backend's context window."""

    @property
    def version(self) -> int:
        """The model version the next turn is expected from (the newest seen, for a remote
        backend)."""
        ...

    def open(self, tools: list[dict[str, Any]], system: str, user: str,
             *extra_user: str) -> W:
        """A fresh window: the tools, the system prompt, the user turns, the assistant's
        header."""
        ...

    def add(self, window: W, content: str) -> None:
        """Append a user turn, then the assistant's header."""
        ...

    def add_results(self, window: W, results: list[tuple[ToolCall, str]]) -> None:
        """Append the results of the last turn's calls, then the assistant's header."""
        ...

    def length(self, window: W) -> int:
        """Tokens in `window` as far as the backend knows."""
        ...

    async def reply(self, window: W, sampling: Sampling) -> ModelTurn:
        """Sample the model's turn into `window`; `ContextFull` when it has no room for one."""
        ...


@dataclass
class Segment:
    """One context window of `EngineTurns`. All lists have the length of `token_ids`;
    logprobs are 0 where the mask is 0. `routes` (rows, layers, k): the experts of the
    window's first `rows` positions as the engine routed them in its last call (later untrained
    tokens have none). `schemas`: the window's tools (their parameters by name), to parse the
    model's calls against."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routes: np.ndarray | None = None
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)

    def extend(self, ids: list[int], *, model: bool = False,
               logprobs: list[float] | None = None) -> None:
        self.token_ids += ids
        self.loss_mask += [int(model)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class Trajectory(Generic[W]):
    task_id: str
    segments: list[W]
    policy_version: int
    reward: float = 0.0
    turns: int = 0
    summaries: int = 0
    # the agent's finish call, its turn budget, or a context with no room for another turn
    ended_by: EndedBy = "turns"
    texts: list[str] = field(default_factory=list)  # the model's turns, decoded
    flags: list[str] = field(default_factory=list)  # anti-cheat: why the reward is 0

    @property
    def finished(self) -> bool:
        """The agent ended the episode itself (its `finish` call)."""
        return self.ended_by == "finished"


def model_tokens(trajectory: Trajectory[Segment]) -> int:
    """Tokens the model sampled in an `EngineTurns` trajectory."""
    return sum(sum(s.loss_mask) for s in trajectory.segments)


class ChatTokens:
    """The chat template's pieces as token ids for one tokenizer: what the template renders,
    encoded the way the server encodes it (special tokens split out, so pieces join to the
    ids of the whole text)."""

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

    def prompt(self, system: str, user: str, *extra_user: str,
               tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The first prompt of a conversation, through the template, up to the assistant's
        header."""
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        messages += [{"role": "user", "content": text} for text in extra_user]
        return self.encode(self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=True))

    def tool_results(self, observations: list[str]) -> list[int]:
        """Tool results as the template writes them: one user turn of <tool_response>s."""
        blocks = "".join(f"<tool_response>\n{o}\n</tool_response>\n" for o in observations)
        return self.turn("user", blocks)


class EngineTurns:
    """`ModelTurns` on an in-process `Engine`: the template's token ids, the sampled tokens'
    logprobs and routes kept for training (`Segment`), calls parsed by `parser`."""

    def __init__(self, engine: Engine, chat: ChatTokens, *, parser: str = DEFAULT_FORMAT
                 ) -> None:
        self.engine = engine
        self.chat = chat
        self.format = FORMATS[parser]

    @property
    def version(self) -> int:
        return self.engine.version.number

    def open(self, tools: list[dict[str, Any]], system: str, user: str,
             *extra_user: str) -> Segment:
        segment = Segment(schemas={t["function"]["name"]: t["function"].get("parameters", {})
                                   for t in tools})
        segment.extend(self.chat.prompt(system, user, *extra_user, tools=tools))
        return segment

    def add(self, window: Segment, content: str) -> None:
        window.extend(self.chat.turn("user", content) + self.chat.open("assistant"))

    def add_results(self, window: Segment, results: list[tuple[ToolCall, str]]) -> None:
        window.extend(self.chat.tool_results([observation for _, observation in results])
                      + self.chat.open("assistant"))

    def length(self, window: Segment) -> int:
        return len(window)

    async def reply(self, window: Segment, sampling: Sampling) -> ModelTurn:
        budget = self.engine.max_context - len(window)
        if budget < 1:
            raise ContextFull(f"{len(window)} tokens fill the context ({self.engine.max_context})")
        result = await self.engine.generate(GenerationRequest(
            prompt_token_ids=list(window.token_ids),
            max_tokens=min(sampling.max_tokens, max(1, budget)),
            temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
            stop_token_ids=(self.chat.im_end,)))
        self._append_model(window, result)
        text = self.chat.decode([t for t in result.token_ids if t != self.chat.im_end])
        parsed = parse_text(CallParser(self.format, window.schemas), text)
        return ModelTurn(text, [ToolCall(e.call.name, e.call.arguments, e.id)
                                for e in parsed.calls])

    def _append_model(self, segment: Segment, result: GenerationResult) -> None:
        segment.extend(list(result.token_ids), model=True, logprobs=list(result.logprobs))
        if result.routed_experts is not None:
            segment.routes = result.routed_experts  # covers the segment up to this turn
        if not result.token_ids or result.token_ids[-1] != self.chat.im_end:
            segment.extend([self.chat.im_end])  # cut at max_tokens: close the turn, untrained
        segment.extend(self.chat.newline)


class Harness(Generic[W]):
    """Runs episodes of one model (through its `ModelTurns`) against `ToolEnvironment`s."""

    def __init__(self, model: ModelTurns[W], config: HarnessConfig) -> None:
        self.model = model
        self.config = config

    @classmethod
    def on_engine(cls, engine: Engine, config: HarnessConfig) -> Harness[Segment]:
        """The bootstrap's harness: token ids on `engine`."""
        return Harness(EngineTurns(engine, ChatTokens(engine.tokenizer)), config)

    async def run(self, env: ToolEnvironment, *, task_id: str, seed: int | None = None,
                  policy_version: int | None = None) -> Trajectory[W]:
        version = policy_version if policy_version is not None else self.model.version
        window = self.model.open(env.tools(), env.system_prompt(), env.task_prompt())
        traj = Trajectory(task_id=task_id, segments=[window], policy_version=version)
        try:
            await self._turns(env, traj, seed)
        except ContextFull:
            traj.ended_by = "context"
        reward = await asyncio.to_thread(env.reward)
        traj.reward, traj.flags = reward.value, reward.flags
        return traj

    async def _turns(self, env: ToolEnvironment, traj: Trajectory[W], seed: int | None) -> None:
        window = traj.segments[-1]
        recent: list[str] = []  # the newest turns' calls and results, for "truncate"
        for turn in range(env.max_turns() or self.config.max_turns):
            if self.model.length(window) > self.config.context_budget \
                    and traj.summaries < self.config.max_summaries:
                window = await (self._truncate(env, traj, recent)
                                if self.config.overflow == "truncate"
                                else self._summarize(env, traj, seed=_turn_seed(seed, turn, 1)))
            said = await self.model.reply(window, self._sampling(_turn_seed(seed, turn, 0)))
            traj.texts.append(said.text)
            traj.turns += 1
            if not said.calls:
                self.model.add(window, NO_CALL)
                continue
            # tools may run the sandbox (a child process): off the loop, so that the other
            # episodes of the batch keep decoding meanwhile
            observations, done = await asyncio.to_thread(env.step, said.calls)
            if done:
                traj.ended_by = "finished"
                return
            results = list(zip(said.calls, observations, strict=False))
            self.model.add_results(window, results)
            recent = (recent + [_describe(c, o) for c, o in results])[-KEEP_RESULTS:]

    def _sampling(self, seed: int | None) -> Sampling:
        return Sampling(max_tokens=self.config.max_tokens, temperature=self.config.temperature,
                        top_p=self.config.top_p, seed=seed)

    async def _summarize(self, env: ToolEnvironment, traj: Trajectory[W], *,
                         seed: int | None) -> W:
        """Ask for a summary in the full context, then restart the context from it."""
        window = traj.segments[-1]
        self.model.add(window, SUMMARIZE_PROMPT)
        summary = await self.model.reply(window, self._sampling(seed))
        return self._reopen(env, traj, SUMMARY_PREFIX + summary.text)

    async def _truncate(self, env: ToolEnvironment, traj: Trajectory[W],
                        recent: list[str]) -> W:
        """The baseline to summarizing: a fresh context holding the newest turns' calls and
        results as they were (the oldest dropped), written by the harness, not the model."""
        return self._reopen(env, traj, TRUNCATED_PREFIX + "\n".join(recent))

    def _reopen(self, env: ToolEnvironment, traj: Trajectory[W], carried: str) -> W:
        """A fresh context window after the task's opening, carrying `carried` over."""
        traj.summaries += 1
        fresh = self.model.open(env.tools(), env.system_prompt(), env.task_prompt(), carried)
        traj.segments.append(fresh)
        return fresh


def _describe(call: ToolCall, observation: str) -> str:
    """One call and its result, as the truncation baseline carries them over."""
    arguments = ", ".join(f"{k}={v!r}" for k, v in call.arguments.items())
    return f"{call.name}({arguments}) -> {observation}"


def _turn_seed(seed: int | None, turn: int, kind: int) -> int | None:
    return None if seed is None else (seed * 1009 + turn * 2 + kind) % 2**62
