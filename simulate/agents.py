"""Agent programs as the bootstrap's environment: the contract, and episodes from their logs.

A product's own agent (its tools, prompts, retries, context handling) is bootstrapped by
running it: a rollout worker starts the agent program once per episode and serves it an
OpenAI-compatible endpoint on the worker's current policy version (`app/rollouts/`). The
agent gets, in its environment (`AGENT_ENV`):

    OPENAI_BASE_URL            the endpoint, http://127.0.0.1:<port>/v1
    OPENAI_API_KEY             the episode's key: every generation made with it is the episode's
    FLYWHEEL_SESSION_ID        the episode's session (its verdict names it)
    FLYWHEEL_TASK              a JSON file: the task (`simulate.tasks.Task`, its tests included)
    FLYWHEEL_WORKSPACE         a directory holding the task's files; the agent edits it
    FLYWHEEL_SAMPLING          JSON: the job's sampling (temperature, max_tokens, max_turns, ...)
    FLYWHEEL_SEED              the episode's seed
    FLYWHEEL_FEEDBACK_URL      where the verdict goes: the webhook's contract, POST /v1/feedback
    FLYWHEEL_FEEDBACK_SECRET   what the verdict is signed with (`ingest.signing`)

It talks to the endpoint however it likes (chat completions, tools, streaming), reports its
verdict on its own session, `{"event_id", "session_id", "kind", "value"}` signed as a webhook
is, and exits 0. The worker logs every generation as `flywheel up` does (`GenerationLogged`:
the token ids served, their logprobs and routes, the version) and builds the episode from
those records (`simulate.rollouts.episode_trajectory`), never from what the agent says it
sent, then scores the workspace with the task's tests and the anti-cheat checks (or takes the
verdict as the reward, `AgentProgram.reward`). An episode that crashed, ran past its
deadline, sent no verdict, a verdict for another session, or more requests than allowed is
dropped and made again (app/rollouts/agent_groups.py).

    program = AgentProgram(command=["{python}", "examples/agents/coding_agent.py"])

(Light on purpose: the bootstrap's settings hold an `AgentProgram`, and `flywheel --help`
imports them without torch.)
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

AGENT_ENV = ("OPENAI_BASE_URL", "OPENAI_API_KEY", "FLYWHEEL_SESSION_ID", "FLYWHEEL_TASK",
             "FLYWHEEL_WORKSPACE", "FLYWHEEL_SAMPLING", "FLYWHEEL_SEED", "FLYWHEEL_FEEDBACK_URL",
             "FLYWHEEL_FEEDBACK_SECRET")
# why an episode was dropped (and made again): counted per reason in the group and the run
DropReason = Literal["crashed", "deadline", "no_verdict", "forged_verdict", "flood",
                     "temperature", "no_generations"]
# the built-in harness as an agent program: a command, and the same as an entry point
BUILTIN_AGENT = ["{python}", "-m", "simulate.builtin_agent"]
BUILTIN_ENTRY_POINT = "simulate.builtin_agent:main"


class AgentProgram(BaseModel):
    """The agent program a rollout worker runs once per episode, and its walls: a command
    (a process started per episode), or a Python entry point (`package.module:function` or
    `path/to/file.py:function`) that a warm host imports once and forks per episode
    (simulate/agent_host.py: the same walls, without an interpreter's start each time)."""

    # argv; "{python}" stands for the worker's interpreter (its virtual environment)
    command: list[str] | None = Field(default=None, min_length=1)
    entry_point: str | None = Field(default=None, pattern=r"^[^:\s]+:[A-Za-z_][A-Za-z0-9_]*$")
    deadline_s: float = Field(default=300.0, gt=0)  # wall clock, start to exit
    # model requests one episode may make (a flood past it is refused, the episode dropped)
    max_requests: int = Field(default=64, ge=1)
    memory_mb: int = Field(default=4096, ge=256)  # address space (RLIMIT_AS)
    cpu_seconds: int = Field(default=300, ge=1)  # RLIMIT_CPU
    output_chars: int = Field(default=4000, ge=0)  # of its stdout/stderr, kept for the log
    attempts: int = Field(default=3, ge=1)  # tries per episode before the job fails
    # the episode's reward: the task's tests on the workspace with the anti-cheat checks
    # ("tests"), or the agent's own verdict through the feedback reward map ("verdict")
    reward: Literal["tests", "verdict"] = "tests"

    @model_validator(mode="after")
    def _one_way_to_start(self) -> AgentProgram:
        if (self.command is None) == (self.entry_point is None):
            raise ValueError("an agent program is a command or an entry point: give one")
        return self

    def argv(self, python: str) -> list[str]:
        """The command, or the warm host's for the entry point."""
        if self.command is None:
            return [python, "-m", "simulate.agent_host", str(self.entry_point)]
        return [python if part == "{python}" else part for part in self.command]
