"""The tool-call format a model emits in a multi-turn rollout, its parser, and the tools.

One call per model turn, in a tagged block whose first line is the tool and its path and whose
remaining lines are raw text, never escaped, so a tiny byte-level model only learns tags::

    <tool>read_file solution.py</tool>
    <tool>write_file solution.py
    def add_3(x):
        return x + 3
    </tool>
    <tool>apply_edit solution.py
    <<<
    return x + 2
    ===
    return x + 3
    >>>
    </tool>
    <tool>run_tests</tool>
    <tool>finish</tool>

Text outside the block is the model's reasoning and is ignored. `ToolWorkspace.step(text)`
parses and runs one turn and always returns an observation string (truncated), also for
garbage: the parser never raises on model text. Paths are relative to the rollout's workspace
and may not leave it; `run_tests` runs the task's tests on the workspace through the sandbox.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from simulate.sandbox import SandboxJob, SandboxLimits, SandboxResult, run_sandboxed
from simulate.tasks import Task

TOOL_NAMES = ("read_file", "write_file", "apply_edit", "run_tests", "finish")
_TAKES_PATH = ("read_file", "write_file", "apply_edit")
_BLOCK = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)
_EDIT = re.compile(r"<<<\n(.*?)\n===\n(.*?)\n?>>>", re.DOTALL)
SOLUTION_FILE = "solution.py"


@dataclass(frozen=True)
class ToolCall:
    name: str
    path: str | None = None
    body: str = ""


@dataclass(frozen=True)
class ToolParseError:
    message: str


def parse_tool_call(text: str) -> ToolCall | ToolParseError:
    """The first `<tool>...</tool>` block of a model turn, or why there is none."""
    match = _BLOCK.search(text)
    if match is None:
        return ToolParseError("no <tool>...</tool> block; end your turn with one tool call")
    header, _, body = match.group(1).lstrip("\n").partition("\n")
    words = header.split()
    if not words or words[0] not in TOOL_NAMES:
        name = words[0] if words else ""
        return ToolParseError(f"unknown tool {name!r}; tools are {', '.join(TOOL_NAMES)}")
    name = words[0]
    if name in _TAKES_PATH and len(words) != 2:
        return ToolParseError(f"{name} takes exactly one path on its first line")
    if name not in _TAKES_PATH and (len(words) != 1 or body.strip()):
        return ToolParseError(f"{name} takes no arguments")
    return ToolCall(name=name, path=words[1] if name in _TAKES_PATH else None, body=body)


def truncate(text: str, limit: int) -> str:
    """Keep the head and the tail, which hold the most useful lines of a long output."""
    if len(text) <= limit:
        return text
    marker = f"\n...[{len(text) - limit} characters cut]...\n"
    keep = max(limit - len(marker), 0)
    return text[: keep // 2] + marker + text[len(text) - (keep - keep // 2):]


@dataclass
class ToolResult:
    observation: str
    done: bool = False
    tests: SandboxResult | None = None  # set by run_tests


@dataclass
class ToolWorkspace:
    """A rollout's private directory holding the task's files and `solution.py`."""

    root: Path
    task: Task
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    max_observation_chars: int = 2000
    finished: bool = False

    @classmethod
    def create(cls, root: Path, task: Task, **options: object) -> ToolWorkspace:
        """Write the task's files and its starting `solution.py` into an empty `root`."""
        root.mkdir(parents=True, exist_ok=True)
        for relative, content in {**task.files, SOLUTION_FILE: task.starting_file}.items():
            (root / relative).parent.mkdir(parents=True, exist_ok=True)
            (root / relative).write_text(content)
        return cls(root=root.resolve(), task=task, **options)  # type: ignore[arg-type]

    def step(self, model_text: str) -> ToolResult:
        """Parse one model turn and run its tool; every outcome is an observation."""
        call = parse_tool_call(model_text)
        if isinstance(call, ToolParseError):
            return self._reply(f"error: {call.message}")
        if self.finished:
            return self._reply("error: the episode is finished", done=True)
        return self.execute(call)

    def execute(self, call: ToolCall) -> ToolResult:
        if call.name == "run_tests":
            return self.run_tests()
        if call.name == "finish":
            self.finished = True
            return self._reply("finished", done=True)
        target = self._resolve(call.path or "")
        if target is None:
            return self._reply(f"error: path {call.path!r} is outside the workspace")
        if call.name == "read_file":
            if not target.is_file():
                return self._reply(f"error: no such file {call.path}")
            return self._reply(target.read_text(errors="replace"))
        if call.name == "write_file":
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(call.body)
            return self._reply(f"wrote {len(call.body)} characters to {call.path}")
        return self._apply_edit(target, call)

    def files(self) -> dict[str, str]:
        """Every text file of the workspace, by relative path."""
        return {str(p.relative_to(self.root)): p.read_text(errors="replace")
                for p in sorted(self.root.rglob("*")) if p.is_file()}

    def sandbox_job(self) -> SandboxJob:
        """`solution.py` is the candidate; the other files travel with it."""
        files = self.files()
        return SandboxJob(code=files.pop(SOLUTION_FILE, ""), tests=self.task.tests,
                          entry_point=self.task.entry_point, files=files, limits=self.limits)

    def run_tests(self) -> ToolResult:
        result = run_sandboxed(self.sandbox_job())
        lines = [f"{result.status}: {result.tests_passed or 0}/{result.tests_total or 0} tests "
                 f"passed", *result.failures]
        if result.stdout_tail or result.stderr_tail:
            lines += ["output:", result.stdout_tail + result.stderr_tail]
        return self._reply("\n".join(lines), tests=result)

    def _apply_edit(self, target: Path, call: ToolCall) -> ToolResult:
        if not target.is_file():
            return self._reply(f"error: no such file {call.path}")
        edits = _EDIT.findall(call.body)
        if not edits:
            return self._reply("error: apply_edit needs <<< old === new >>> blocks")
        text = target.read_text()
        for old, new in edits:
            if text.count(old) != 1:
                found = "not found" if old not in text else "found more than once"
                return self._reply(f"error: search text {found} in {call.path}; nothing changed")
            text = text.replace(old, new)
        target.write_text(text)
        return self._reply(f"applied {len(edits)} edit(s) to {call.path}")

    def _resolve(self, relative: str) -> Path | None:
        target = (self.root / relative).resolve()
        return target if target.is_relative_to(self.root) and target != self.root else None

    def _reply(self, text: str, *, done: bool = False,
               tests: SandboxResult | None = None) -> ToolResult:
        return ToolResult(truncate(text, self.max_observation_chars), done=done, tests=tests)
