"""The built-in tools: calls parsed from model text the way the server parses them (and never
raising on garbage), their arguments checked, and the tools on a real workspace and a real
sandbox."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulate.tasks import BuiltinTasksConfig, Task, ToolSet, build_task_source
from simulate.tools import TOOL_NAMES, ToolCall, ToolWorkspace, calls_in, render_call, truncate


@pytest.fixture
def add_3(tmp_path: Path) -> ToolWorkspace:
    tasks = {t.task_id: t for t in build_task_source(BuiltinTasksConfig()).tasks()}
    return ToolWorkspace.create(tmp_path / "ws", tasks["builtin/add_3"])


def write(path: str, content: str) -> ToolCall:
    return ToolCall("write_file", {"path": path, "content": content})


def edit(old: str, new: str) -> ToolCall:
    return ToolCall("apply_edit", {"path": "solution.py", "old": old, "new": new})


def test_calls_in_model_text_carry_code_unescaped() -> None:
    call = write("solution.py", "def f(x):\n    return '\\n'\n")
    text = "I will fix it.\n" + render_call(call) + render_call(ToolCall("finish"))
    (first, second) = calls_in(text)
    assert (first.name, first.arguments) == (call.name, call.arguments)
    assert (second.name, second.arguments) == ("finish", {}) and first.id != second.id


@pytest.mark.parametrize("call, message", [
    (ToolCall("delete_everything", {}), "unknown tool 'delete_everything'"),
    (ToolCall("read_file", {}), "needs the text argument 'path'"),
    (ToolCall("read_file", {"path": 3}), "needs the text argument 'path'"),
    (ToolCall("finish", {"now": "yes"}), "takes no argument 'now'"),
])
def test_bad_calls_are_refused_with_the_reason(add_3: ToolWorkspace, call: ToolCall,
                                               message: str) -> None:
    result = add_3.run(call)
    assert result.observation.startswith("error:") and message in result.observation
    assert not result.done


def test_write_then_run_tests_passes(add_3: ToolWorkspace) -> None:
    read = add_3.run(ToolCall("read_file", {"path": "solution.py"}))
    assert read.observation == add_3.task.starting_file
    written = add_3.run(write("solution.py", "def add_3(x):\n    return x + 3\n"))
    assert written.observation == "wrote 31 characters to solution.py"  # 14 + 17
    result = add_3.run(ToolCall("run_tests"))
    assert result.observation == "passed: 4/4 tests passed" and not result.done
    assert result.tests is not None and result.tests.status == "passed"


def test_edit_and_failing_tests(add_3: ToolWorkspace) -> None:
    add_3.run(write("solution.py", "def add_3(x):\n    return x + 2\n"))
    failing = add_3.run(ToolCall("run_tests"))
    assert failing.observation.startswith("failed: 0/4 tests passed")
    missing = add_3.run(edit("x - 2", "x + 3"))
    assert "not found" in missing.observation
    twice = add_3.run(edit("x", "y"))
    assert "found more than once" in twice.observation
    fixed = add_3.run(edit("x + 2", "x + 3"))
    assert fixed.observation == "edited solution.py"
    assert add_3.run(ToolCall("run_tests")).observation == "passed: 4/4 tests passed"


def test_paths_cannot_leave_the_workspace(add_3: ToolWorkspace) -> None:
    result = add_3.run(write("../escaped.py", "print('hi')\n"))
    assert "outside the workspace" in result.observation
    assert not (add_3.root.parent / "escaped.py").exists()
    absolute = add_3.run(ToolCall("read_file", {"path": "/etc/passwd"}))
    assert "outside the workspace" in absolute.observation
    missing = add_3.run(ToolCall("read_file", {"path": "nope.py"}))
    assert missing.observation == "error: no such file nope.py"


def test_finish_ends_the_episode(add_3: ToolWorkspace) -> None:
    assert add_3.run(ToolCall("finish")).done
    after = add_3.run(ToolCall("run_tests"))
    assert after.done and after.observation == "error: the episode is finished"


def test_repo_task_files_travel_to_the_sandbox(tmp_path: Path) -> None:
    task = Task(task_id="repo", prompt="from helpers import base\n", entry_point="f",
                tests="def test_f():\n    assert f(2) == 12\n",
                files={"helpers.py": "base = 10\n"})
    workspace = ToolWorkspace.create(tmp_path / "repo", task)
    workspace.run(write("solution.py",
                        "from helpers import base\ndef f(x):\n    return base + x\n"))
    assert workspace.run(ToolCall("run_tests")).observation == "passed: 1/1 tests passed"


def test_observations_are_truncated(add_3: ToolWorkspace) -> None:
    add_3.max_observation_chars = 60
    add_3.run(write("big.txt", "x" * 500))
    observation = add_3.run(ToolCall("read_file", {"path": "big.txt"})).observation
    assert len(observation) == 60 and "characters cut" in observation
    assert truncate("short", 60) == "short"


# ---- property-based: any model text -------------------------------------------------------
_PIECES = st.sampled_from(["<tool_call>", "</tool_call>", "<function=", "</function>",
                           "<parameter=", "</parameter>", ">", *TOOL_NAMES, "path", " ", "\n",
                           "solution.py", "x", "\t", "é", "{", '"'])
_MODEL_TEXT = st.one_of(st.text(max_size=300), st.lists(_PIECES, max_size=40).map("".join))


@given(text=_MODEL_TEXT)
def test_any_model_text_parses_to_calls_of_known_tools(text: str) -> None:
    for call in calls_in(text):
        assert call.name in TOOL_NAMES and isinstance(call.arguments, dict)


_TEXT = st.text(max_size=200).filter(lambda t: "</parameter>" not in t)


@given(content=_TEXT, path=st.text(st.characters(blacklist_categories=["Z", "C"]),
                                   min_size=1, max_size=30),
       before=st.text(max_size=50).filter(lambda t: "<tool_call>" not in t))
def test_a_rendered_call_parses_back_to_itself(content: str, path: str, before: str) -> None:
    call = write(path, content)
    (parsed,) = calls_in(before + render_call(call))
    assert (parsed.name, parsed.arguments) == (call.name, call.arguments)


def package_task(tools: ToolSet) -> Task:
    """A small package: a module, its tests in their own folder."""
    tests = "from pkg.core import double\n\ndef test_double():\n    assert double(2) == 4\n"
    return Task(task_id="pkg/1", prompt="", entry_point="double", tools=tools, tests=tests,
                files={"pkg/__init__.py": "", "pkg/core.py": "def double(x):\n    return x + x\n",
                       "tests/test_core.py": "from pkg.core import double\n"})


def test_a_coding_task_offers_listing_searching_and_commands(tmp_path: Path) -> None:
    from simulate.sandbox import SandboxLimits

    ws = ToolWorkspace.create(tmp_path / "ws", package_task("coding"),
                              limits=SandboxLimits(wall_seconds=2))
    listed = ws.run(ToolCall("list_files")).observation.splitlines()
    assert listed == ["pkg/__init__.py", "pkg/core.py", "solution.py", "tests/test_core.py"]
    assert ws.run(ToolCall("search", {"text": "import double"})).observation == \
        "tests/test_core.py:1: from pkg.core import double"
    assert ws.run(ToolCall("search", {"text": "nowhere"})).observation == "no match"
    ran = ws.run(ToolCall("run", {"command": "python3 -c 'from pkg.core import double; "
                                             "print(double(21))'"}))
    assert ran.observation == "exit code 0\n42\n"
    failed = ws.run(ToolCall("run", {"command": "ls missing"})).observation
    assert failed.startswith("exit code 2\n") and "missing" in failed
    # a command works on a copy: what it writes is not kept
    assert ws.run(ToolCall("run", {"command": "echo x > new.txt"})).observation == "exit code 0"
    assert "new.txt" not in ws.run(ToolCall("list_files")).observation
    assert ws.run(ToolCall("run", {"command": "sleep 30"})).observation == "timed out (killed)"


def test_a_basic_task_refuses_the_coding_tools(tmp_path: Path) -> None:
    ws = ToolWorkspace.create(tmp_path / "ws", package_task("basic"))
    refused = ws.run(ToolCall("run", {"command": "ls"})).observation
    assert refused.startswith("error: unknown tool 'run'; tools are read_file")


def test_the_rollout_environment_offers_a_tasks_tools_and_runs_commands(tmp_path: Path) -> None:
    """The environment sends commands through its sandbox runner (the sandbox fleet when it
    has one); the tools it offers the model are the task's set."""
    from simulate.rollouts import SandboxCache, TaskEnvironment
    from simulate.tools import CODING_TOOLS, TOOLS

    env = TaskEnvironment(package_task("coding"), tmp_path / "w", SandboxCache())
    assert env.tools() == CODING_TOOLS
    (observation,), done = env.step([ToolCall("run", {"command": "cat pkg/core.py"})])
    assert observation == "exit code 0\ndef double(x):\n    return x + x\n" and not done
    basic = TaskEnvironment(package_task("basic"), tmp_path / "b", SandboxCache())
    assert basic.tools() == TOOLS
    (refused,), _ = basic.step([ToolCall("run", {"command": "ls"})])
    assert refused.startswith("error: unknown tool 'run'")
