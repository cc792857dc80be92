"""The episode a good agent would have on a task, as token ids through the model's chat template.

A one-line task with a canonical solution has one: system prompt, the task, an `apply_edit`
of the stub's `pass` into the canonical body (a `write_file` of the whole program for tasks
without a stub), `run_tests` and its observation, `finish`. A long task (its `fixes`,
simulate/package_tasks.py) has a longer one: list the files, read the test files, then for
each file to fix read it, make its edits and run the tests; `finish`. Its observations are
the harness's own (the tools run on a real workspace, the tests in the sandbox), and when
the context passes the harness's budget the episode summarizes as the harness makes it:
the summary request, a summary of what the episode has learned so far (`Notes`), and a fresh
window opening with it: one (ids, mask) per window (`windows`). Mid-training learns from
these (`trainer/bootstrap/midtrain.py`), and the online trainer's format anchor holds its
policy to the served release on them (`trainer/online/anchor.py`).
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from simulate.harness import SUMMARIZE_PROMPT, SUMMARY_PREFIX, ChatTokens
from simulate.rewards import test_files
from simulate.rollouts import SYSTEM_PROMPT, SandboxCache, TaskEnvironment
from simulate.tasks import STUB_BODY, Task
from simulate.tools import SOLUTION_FILE, TOOL_SETS, TOOLS, ToolCall, ToolWorkspace, render_call


def demonstration_call(task: Task) -> ToolCall:
    """The tool call that solves `task` in one turn: replace the stub's `pass` line with the
    canonical body, or write the whole program when the task has no such stub."""
    solution = task.canonical_solution or ""
    old = STUB_BODY.rstrip("\n")
    if task.stub is not None and task.stub.count(old) == 1:
        return ToolCall("apply_edit", {"path": SOLUTION_FILE, "old": old,
                                       "new": solution.rstrip("\n")})
    return ToolCall("write_file", {"path": SOLUTION_FILE, "content": task.prompt + solution})


def first_call(chat: ChatTokens, task: Task) -> tuple[list[int], list[int]]:
    """(token ids, mask) of the episode's opening and the demonstration's first call, the
    mask on the call: what the model must write to solve `task` in one turn."""
    ids = chat.prompt(SYSTEM_PROMPT, task.starting_file, tools=TOOLS)
    reply = chat.encode(render_call(demonstration_call(task))) + [chat.im_end]
    return ids + reply, [0] * len(ids) + [1] * len(reply)


def demonstration_calls(task: Task) -> list[ToolCall]:
    """The calls of `task`'s demonstration episode, in order."""
    if not task.fixes:
        return [demonstration_call(task), ToolCall("run_tests"), ToolCall("finish")]
    calls = [ToolCall("list_files")]
    calls += [ToolCall("read_file", {"path": path}) for path in sorted(test_files(task.files))]
    for path in dict.fromkeys(fix.path for fix in task.fixes):
        calls.append(ToolCall("read_file", {"path": path}))
        calls += [ToolCall("apply_edit", {"path": path, "old": fix.old, "new": fix.new})
                  for fix in task.fixes if fix.path == path]
        calls.append(ToolCall("run_tests"))
    return calls + [ToolCall("finish")]


def _observations(task: Task, calls: list[ToolCall]) -> list[str]:
    """What the harness's environment answers to each call but the last (`finish`). A
    one-line task's come from its workspace and a fixed test report (every test passes);
    a long task's from a `TaskEnvironment`, the tests run in the sandbox."""
    with tempfile.TemporaryDirectory(prefix="demonstration-") as tmp:
        if not task.fixes:
            edited = ToolWorkspace.create(Path(tmp), task).run(calls[0]).observation
            tests = len(re.findall(r"^def test_", task.tests, flags=re.M))
            return [edited, f"passed: {tests}/{tests} tests passed"]
        env = TaskEnvironment(task, Path(tmp), SandboxCache())
        return [env.step([call])[0][0] for call in calls[:-1]]


@dataclass
class Notes:
    """What a long task's episode has learned so far, as its summary says it (in fewer
    tokens than a turn may have): the lines the tests want, the lines to fix where they were
    read, the files fixed."""

    task: Task
    wants: str = ""
    found: dict[str, str] = field(default_factory=dict)
    fixed: list[str] = field(default_factory=list)

    def saw(self, call: ToolCall, observation: str) -> None:
        path = call.arguments.get("path", "")
        fixes = [f for f in self.task.fixes if f.path == path]
        if call.name == "read_file" and path in test_files(self.task.files):
            self.wants = "Want " + ", ".join(f.new for f in self.task.fixes) + "."
        elif call.name == "read_file" and fixes and path not in self.fixed:
            self.found[path] = f"{path}: " + ", ".join(f.old for f in fixes) + "."
        elif call.name == "apply_edit" and observation.startswith("edited"):
            self.found.pop(path, None)
            self.fixed.append(path)

    def text(self) -> str:
        fixed = f"Fixed {', '.join(self.fixed)}." if self.fixed else ""
        return "\n".join(line for line in (self.wants, *self.found.values(), fixed) if line)


def transcript(chat: ChatTokens, task: Task) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of the demonstration episode for `task` in one window."""
    return windows(chat, task)[0]


def windows(chat: ChatTokens, task: Task, *, context_budget: int | None = None,
            max_summaries: int = 0) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) of each context window of the demonstration episode for `task`,
    through the model's chat template with the task's tools, each call as the template
    writes it; past `context_budget` tokens before a turn (at most `max_summaries` times),
    the harness's summary and a fresh window, as `simulate.harness.Harness` makes them."""
    tools = TOOL_SETS[task.tools]
    calls = demonstration_calls(task)
    observations = _observations(task, calls)
    ids = chat.prompt(SYSTEM_PROMPT, task.starting_file, tools=tools)
    mask, notes = [0] * len(ids), Notes(task)
    done: list[tuple[list[int], list[int]]] = []
    for i, call in enumerate(calls):
        if context_budget is not None and len(ids) > context_budget \
                and len(done) < max_summaries:
            summary = notes.text()
            request = chat.turn("user", SUMMARIZE_PROMPT) + chat.open("assistant")
            reply = chat.encode(summary) + [chat.im_end]
            ids += request + reply + chat.newline
            mask += [0] * len(request) + [1] * len(reply) + [0] * len(chat.newline)
            done.append((ids, mask))
            ids = chat.prompt(SYSTEM_PROMPT, task.starting_file, SUMMARY_PREFIX + summary,
                              tools=tools)
            mask = [0] * len(ids)
        reply = chat.encode(render_call(call)) + [chat.im_end]
        ids += reply + chat.newline
        mask += [1] * len(reply) + [0] * len(chat.newline)
        if i < len(observations):
            notes.saw(call, observations[i])
            obs = chat.tool_results([observations[i]]) + chat.open("assistant")
            ids += obs
            mask += [0] * len(obs)
    return [*done, (ids, mask)]
