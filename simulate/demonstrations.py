"""The episode a good agent would have on a task, as token ids through the model's chat template.

A task with a canonical solution has one: system prompt, the task, an `apply_edit` of the
stub's `pass` into the canonical body (a `write_file` of the whole program for tasks without a
stub), `run_tests` and its observation, `finish`. Mid-training learns from these
(`trainer/bootstrap/midtrain.py`), and the online trainer's format anchor holds its policy to
the served release on them (`trainer/online/anchor.py`).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from simulate.harness import ChatTokens
from simulate.rollouts import SYSTEM_PROMPT
from simulate.tasks import STUB_BODY, Task
from simulate.tools import SOLUTION_FILE, TOOLS, ToolCall, ToolWorkspace, render_call


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


def transcript(chat: ChatTokens, task: Task) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of the demonstration episode for `task`, through the model's
    chat template with the built-in tools, each call as the template writes it."""
    ids = chat.prompt(SYSTEM_PROMPT, task.starting_file, tools=TOOLS)
    mask = [0] * len(ids)
    first = demonstration_call(task)
    turns = [first, ToolCall("run_tests"), ToolCall("finish")]
    tests = len(re.findall(r"^def test_", task.tests, flags=re.M))
    with tempfile.TemporaryDirectory(prefix="midtrain-") as tmp:  # the tool's own reply
        edited = ToolWorkspace.create(Path(tmp), task).run(first).observation
    observations = [edited, f"passed: {tests}/{tests} tests passed"]
    for i, turn in enumerate(turns):
        reply = chat.encode(render_call(turn)) + [chat.im_end]
        ids += reply + chat.newline
        mask += [1] * len(reply) + [0] * len(chat.newline)
        if i < len(observations):
            obs = chat.tool_results([observations[i]]) + chat.open("assistant")
            ids += obs
            mask += [0] * len(obs)
    return ids, mask
