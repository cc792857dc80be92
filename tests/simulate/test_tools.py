"""The tool-call parser on garbage, and the tools on a real workspace and a real sandbox."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from simulate.tasks import BuiltinTasksConfig, Task, build_task_source
from simulate.tools import (
    ToolCall,
    ToolParseError,
    ToolWorkspace,
    parse_tool_call,
    truncate,
)


@pytest.fixture
def add_3(tmp_path: Path) -> ToolWorkspace:
    tasks = {t.task_id: t for t in build_task_source(BuiltinTasksConfig()).tasks()}
    return ToolWorkspace.create(tmp_path / "ws", tasks["builtin/add_3"])


def test_parses_a_call_with_a_raw_multiline_body() -> None:
    text = "I will fix it.\n<tool>write_file solution.py\ndef f(x):\n    return '\\n'\n</tool>"
    assert parse_tool_call(text) == ToolCall("write_file", "solution.py",
                                             "def f(x):\n    return '\\n'\n")
    assert parse_tool_call("<tool>run_tests</tool> <tool>finish</tool>") == ToolCall("run_tests")


@pytest.mark.parametrize("text, message", [
    ("just thinking out loud", "no <tool>"),
    ("<tool>write_file solution.py", "no <tool>"),  # never closed
    ("<tool>delete_everything /</tool>", "unknown tool 'delete_everything'"),
    ("<tool></tool>", "unknown tool ''"),
    ("<tool>read_file</tool>", "exactly one path"),
    ("<tool>read_file a.py b.py</tool>", "exactly one path"),
    ("<tool>finish now</tool>", "takes no arguments"),
])
def test_malformed_calls_are_parse_errors(text: str, message: str) -> None:
    parsed = parse_tool_call(text)
    assert isinstance(parsed, ToolParseError) and message in parsed.message


def test_parser_never_raises_on_random_model_text() -> None:
    rng = random.Random(0)
    pieces = ["<tool>", "</tool>", "read_file", "write_file", "apply_edit", " ", "\n", "<<<",
              "===", ">>>", "a.py", "\x00", "\udcff", "é", "{", "run_tests", "finish"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        assert isinstance(parse_tool_call(text), ToolCall | ToolParseError)


def test_write_then_run_tests_passes(add_3: ToolWorkspace) -> None:
    assert add_3.step("<tool>read_file solution.py</tool>").observation == add_3.task.starting_file
    write = add_3.step('<tool>write_file solution.py\ndef add_3(x):\n    return x + 3\n</tool>')
    assert write.observation == "wrote 31 characters to solution.py"  # 14 + 17
    result = add_3.step("<tool>run_tests</tool>")
    assert result.observation == "passed: 4/4 tests passed"
    assert result.tests is not None and result.tests.status == "passed"


def test_apply_edit_fixes_a_bug_and_refuses_ambiguous_edits(add_3: ToolWorkspace) -> None:
    add_3.step("<tool>write_file solution.py\ndef add_3(x):\n    return x + 2\n</tool>")
    failing = add_3.step("<tool>run_tests</tool>")
    assert failing.observation.startswith("failed: 0/4 tests passed\ntest_0: AssertionError")
    missing = add_3.step("<tool>apply_edit solution.py\n<<<\nx - 2\n===\nx + 3\n>>>\n</tool>")
    assert missing.observation == "error: search text not found in solution.py; nothing changed"
    twice = add_3.step("<tool>apply_edit solution.py\n<<<\nx\n===\ny\n>>>\n</tool>")
    assert "found more than once" in twice.observation
    fixed = add_3.step("<tool>apply_edit solution.py\n<<<\nx + 2\n===\nx + 3\n>>>\n</tool>")
    assert fixed.observation == "applied 1 edit(s) to solution.py"
    assert add_3.step("<tool>run_tests</tool>").observation == "passed: 4/4 tests passed"


def test_paths_cannot_leave_the_workspace(add_3: ToolWorkspace, tmp_path: Path) -> None:
    result = add_3.step("<tool>write_file ../escaped.py\nprint('hi')\n</tool>")
    assert result.observation == "error: path '../escaped.py' is outside the workspace"
    assert not (tmp_path / "escaped.py").exists()
    absolute = add_3.step("<tool>read_file /etc/passwd</tool>")
    assert "outside the workspace" in absolute.observation
    assert add_3.step("<tool>read_file nope.py</tool>").observation == "error: no such file nope.py"


def test_finish_ends_the_episode(add_3: ToolWorkspace) -> None:
    assert add_3.step("<tool>finish</tool>").done
    after = add_3.step("<tool>run_tests</tool>")
    assert after.done and after.observation == "error: the episode is finished"


def test_repo_task_files_travel_to_the_sandbox(tmp_path: Path) -> None:
    task = Task(task_id="repo", prompt="from helpers import base\n", entry_point="f",
                tests="def test_f():\n    assert f(2) == 12\n",
                files={"helpers.py": "base = 10\n"})
    workspace = ToolWorkspace.create(tmp_path / "repo", task)
    workspace.step("<tool>write_file solution.py\nfrom helpers import base\n"
                   "def f(x):\n    return base + x\n</tool>")
    assert workspace.step("<tool>run_tests</tool>").observation == "passed: 1/1 tests passed"


def test_observations_are_truncated(add_3: ToolWorkspace) -> None:
    add_3.max_observation_chars = 60
    add_3.step("<tool>write_file big.txt\n" + "x" * 500 + "\n</tool>")
    observation = add_3.step("<tool>read_file big.txt</tool>").observation
    assert len(observation) == 60 and "characters cut" in observation
    assert truncate("short", 60) == "short"


# ---- property-based: any model text -------------------------------------------------------
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_PIECES = st.sampled_from(["<tool>", "</tool>", "read_file", "write_file", "apply_edit",
                           "run_tests", "finish", " ", "\n", "solution.py", "<<<", "===",
                           ">>>", "x", "\t", "é"])
_MODEL_TEXT = st.one_of(st.text(max_size=300), st.lists(_PIECES, max_size=30).map("".join))


@given(text=_MODEL_TEXT)
def test_the_parser_answers_any_model_text(text: str) -> None:
    call = parse_tool_call(text)
    assert isinstance(call, ToolCall | ToolParseError)
    if isinstance(call, ToolCall):
        assert call.name in ("read_file", "write_file", "apply_edit", "run_tests", "finish")
        assert (call.path is None) == (call.name in ("run_tests", "finish"))


_PATH = st.text(st.characters(blacklist_categories=["Z", "C"]), min_size=1, max_size=30)
_BODY = st.text(max_size=200).filter(lambda b: "</tool>" not in b)


@given(name=st.sampled_from(["read_file", "write_file", "apply_edit"]), path=_PATH,
       body=_BODY, before=st.text(max_size=50).filter(lambda t: "<tool>" not in t))
def test_a_well_formed_call_parses_back_to_itself(name: str, path: str, body: str,
                                                  before: str) -> None:
    assert parse_tool_call(f"{before}<tool>{name} {path}\n{body}</tool>") == ToolCall(
        name=name, path=path, body=body)
