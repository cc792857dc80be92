"""The long tasks (simulate/package_tasks.py): packages with a bug in two modules, their
demonstrations with the harness's summaries, and the harness running them to the end."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from serving.tool_parsers import CallParser, parse_text
from simulate.demonstrations import demonstration_calls, windows
from simulate.harness import (
    SUMMARIZE_PROMPT,
    SUMMARY_PREFIX,
    TRUNCATED_PREFIX,
    ChatTokens,
    EngineTurns,
    Harness,
    HarnessConfig,
    ModelTurn,
    Sampling,
    Segment,
)
from simulate.rollouts import SandboxCache, TaskEnvironment
from simulate.tasks import BuiltinTasksConfig, Task, build_task_source
from simulate.tools import ToolCall

BUDGET, MAX_TOKENS = 1024, 64  # the bootstrap's defaults (BootstrapSettings)


@pytest.fixture(scope="module")
def packages() -> list[Task]:
    source = build_task_source(BuiltinTasksConfig(packages=True))
    return [t for t in source.tasks() if t.fixes]


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    from serving.torch_engine import TorchEngine

    e = TorchEngine.load(model_dir, seed=0, threads=1)
    yield e
    e.close()


def test_the_package_tasks_join_the_builtin_source_only_when_asked() -> None:
    plain = build_task_source(BuiltinTasksConfig()).tasks()
    source = build_task_source(BuiltinTasksConfig(packages=True))
    both = source.tasks()
    assert both[:len(plain)] == plain  # no one-line task moved
    long = both[len(plain):]
    assert long and all(t.fixes and t.tools == "coding" and t.max_turns for t in long)
    assert {source.split_of(t) for t in long if t.family == "pkg_window"} == {
        "held_out_family"}
    assert {source.split_of(t) for t in long if t.family != "pkg_window"} == {
        "train", "product", "held_out"}


def test_each_demonstration_solves_its_task_and_its_first_fix_half_does(
        packages: list[Task], tmp_path: Path) -> None:
    """The calls read before they write; the tests fail at the start, pass some after the
    first module's fix, and all at the end."""
    cache = SandboxCache()
    for i, task in enumerate(packages[::7]):
        env = TaskEnvironment(task, tmp_path / str(i), cache)
        assert env.test_result().tests_passed == 0
        calls = demonstration_calls(task)
        assert [c.name for c in calls] == ["list_files", "read_file", "read_file", "apply_edit",
                                           "run_tests", "read_file", "apply_edit", "run_tests",
                                           "finish"]
        observations = [env.step([call])[0][0] for call in calls[:5]]
        assert observations[3] == f"edited {task.fixes[0].path}"
        assert observations[4].startswith("failed: ")
        assert not observations[4].startswith("failed: 0/")
        for call in calls[5:]:
            env.step([call])
        assert env.reward().value == 1.0, task.task_id


def test_a_demonstration_summarizes_as_the_harness_does_past_the_budget(
        packages: list[Task], model_dir: Path) -> None:
    """At the bootstrap's budget every long demonstration has two windows: the first ends
    with the summary request and a summary short enough for one turn (trained), the second
    opens with it; the summary holds what the rest of the episode needs."""
    from transformers import AutoTokenizer

    chat = ChatTokens(AutoTokenizer.from_pretrained(model_dir))
    for task in packages[::5]:
        first, second = windows(chat, task, context_budget=BUDGET, max_summaries=2)
        ids, mask = first
        summary = [t for t, m in zip(ids[-MAX_TOKENS - 2:], mask[-MAX_TOKENS - 2:],
                                     strict=True) if m]
        assert len(summary) <= MAX_TOKENS and summary[-1] == chat.im_end
        text = chat.decode(summary)
        assert SUMMARIZE_PROMPT in chat.decode(ids) and f"Want {task.fixes[0].new}" in text
        assert SUMMARY_PREFIX + text in chat.decode(second[0])
        assert len(windows(chat, task)) == 1  # no budget: one window


class Scripted(EngineTurns):
    """The model's turns read from a script of token ids instead of sampled."""

    def __init__(self, engine, chat: ChatTokens, replies: list[list[int]]) -> None:
        super().__init__(engine, chat)
        self.replies = iter(replies)

    async def reply(self, window: Segment, sampling: Sampling) -> ModelTurn:
        ids = next(self.replies)
        window.extend(ids, model=True)
        window.extend(self.chat.newline)
        text = self.chat.decode([t for t in ids if t != self.chat.im_end])
        parsed = parse_text(CallParser(self.format, window.schemas), text)
        return ModelTurn(text, [ToolCall(e.call.name, e.call.arguments, e.id)
                                for e in parsed.calls])


def _model_spans(mask_windows: list[tuple[list[int], list[int]]]) -> list[list[int]]:
    """The model's turns of a demonstration (its runs of loss-masked tokens), in order."""
    spans: list[list[int]] = []
    for ids, mask in mask_windows:
        for i, (token, m) in enumerate(zip(ids, mask, strict=True)):
            if m and (i == 0 or not mask[i - 1]):
                spans.append([])
            if m:
                spans[-1].append(token)
    return spans


def test_the_harness_runs_a_demonstration_into_the_same_windows(
        engine, packages: list[Task], tmp_path: Path) -> None:
    """A model that says the demonstration's turns gets, from the harness at the defaults'
    budget, the demonstration's windows token for token: 9 turns, one summary, solved within
    the task's own turn limit (above the harness's 3)."""
    chat = ChatTokens(engine.tokenizer)
    task = packages[3]
    expected = windows(chat, task, context_budget=BUDGET, max_summaries=2)
    harness = Harness(Scripted(engine, chat, _model_spans(expected)),
                      HarnessConfig(max_turns=3, max_tokens=MAX_TOKENS, context_budget=BUDGET))
    env = TaskEnvironment(task, tmp_path / "w", SandboxCache())
    traj = asyncio.run(harness.run(env, task_id=task.task_id))
    assert (traj.turns, traj.summaries, traj.ended_by, traj.reward) == (9, 1, "finished", 1.0)
    assert [(s.token_ids, s.loss_mask) for s in traj.segments] == expected


def test_the_truncation_baseline_carries_the_newest_results_over(
        engine, packages: list[Task], tmp_path: Path) -> None:
    """`overflow="truncate"`: no summary turn; the fresh window opens with the last two calls
    and their results, as the harness wrote them."""
    chat = ChatTokens(engine.tokenizer)
    task = packages[3]
    script = [s for s in _model_spans(windows(chat, task)) if s]
    harness = Harness(Scripted(engine, chat, script),
                      HarnessConfig(max_tokens=MAX_TOKENS, context_budget=BUDGET,
                                    overflow="truncate"))
    env = TaskEnvironment(task, tmp_path / "w", SandboxCache())
    traj = asyncio.run(harness.run(env, task_id=task.task_id))
    assert (traj.turns, traj.summaries, traj.reward) == (9, 1, 1.0)
    first, second = (chat.decode(s.token_ids) for s in traj.segments)
    assert SUMMARIZE_PROMPT not in first
    carried = second[second.index(TRUNCATED_PREFIX) + len(TRUNCATED_PREFIX):]
    assert carried.startswith("run_tests() -> failed: ") or carried.startswith("read_file(")
    assert sum(second.count(name + "(") for name in ("read_file", "run_tests",
                                                      "apply_edit", "list_files")) >= 2
