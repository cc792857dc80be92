"""The built-in agent's tools, as OpenAI function tools, and the workspace they act on.

The model calls them through OpenAI function calling: the tools reach it through its chat
template and its calls come back parsed (`serving.tool_parsers`), by the server for an
editor's agent or by the harness for the bootstrap's in-process rollouts. In the default
model's format (Qwen3-Coder's) a call carries each argument as raw text, never escaped::

    <tool_call>
    <function=apply_edit>
    <parameter=path>
    solution.py
    </parameter>
    <parameter=old>
        pass
    </parameter>
    <parameter=new>
        return x + 3
    </parameter>
    </function>
    </tool_call>

`ToolWorkspace.run(call)` checks a call's arguments and runs it, and always returns an
observation string (truncated), also for a call it refuses: nothing a model writes raises.
Paths are relative to the rollout's workspace and may not leave it; `run_tests` runs the
task's tests on the workspace through the sandbox.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serving.tool_parsers import FORMATS, CallParser, ParsedCall, parse_text
from simulate.sandbox import SandboxJob, SandboxLimits, SandboxResult, run_sandboxed
from simulate.tasks import Task, ToolSet

SOLUTION_FILE = "solution.py"
_TEXT: dict[str, Any] = {"type": "string"}


def _tool(name: str, description: str, **parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description, "parameters": {
            "type": "object", "properties": parameters, "required": list(parameters)}}}


# short descriptions: every episode's prompt carries them (docs/serving.md)
TOOLS: list[dict[str, Any]] = [
    _tool("read_file", "Read a file.", path=_TEXT),
    _tool("write_file", "Write a whole file.", path=_TEXT, content=_TEXT),
    _tool("apply_edit", "Replace old with new.", path=_TEXT, old=_TEXT, new=_TEXT),
    _tool("run_tests", "Run the tests."),
    _tool("finish", "End the task."),
]
# what a coding agent has besides: offered to tasks whose `tools` is "coding" (the workspace
# keeps the episode's files; `run` works on a copy of them in the sandbox)
CODING_TOOLS: list[dict[str, Any]] = [
    *TOOLS,
    _tool("list_files", "List the files."),
    _tool("search", "Find the lines holding text, in every file.", text=_TEXT),
    _tool("run", "Run a shell command; its files changes are not kept.", command=_TEXT),
]
TOOL_SETS: dict[ToolSet, list[dict[str, Any]]] = {"basic": TOOLS, "coding": CODING_TOOLS}
TOOL_NAMES = tuple(t["function"]["name"] for t in TOOLS)
MAX_MATCHES = 50  # lines `search` reports
DEFAULT_FORMAT = "qwen3_coder"  # the default model's (trainer/init_model.py)


def schemas_of(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each tool's parameters schema, by name."""
    return {t["function"]["name"]: t["function"]["parameters"] for t in tools}


SCHEMA_SETS = {name: schemas_of(tools) for name, tools in TOOL_SETS.items()}
SCHEMAS = SCHEMA_SETS["basic"]


@dataclass(frozen=True)
class ToolCall:
    """One call of a model turn: `id` pairs it with its result in the conversation."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str = ""


def calls_in(text: str, *, parser: str = DEFAULT_FORMAT) -> list[ToolCall]:
    """The calls of the built-in tools in a model's text, as the server would parse them."""
    parsed = parse_text(CallParser(FORMATS[parser], SCHEMAS), text)
    return [ToolCall(e.call.name, e.call.arguments, e.id) for e in parsed.calls]


def render_call(call: ToolCall, *, parser: str = DEFAULT_FORMAT) -> str:
    """A call as the model's template writes it in an assistant turn."""
    return FORMATS[parser].render(ParsedCall(call.name, call.arguments))


def check_call(call: ToolCall, tools: ToolSet = "basic") -> str | None:
    """Why `call` cannot run (a tool the task does not offer, a missing or non-text
    argument), or None."""
    schemas = SCHEMA_SETS[tools]
    if call.name not in schemas:
        return f"unknown tool {call.name!r}; tools are {', '.join(schemas)}"
    for name in schemas[call.name]["properties"]:
        if not isinstance(call.arguments.get(name), str):
            return f"{call.name} needs the text argument {name!r}"
    extra = set(call.arguments) - set(schemas[call.name]["properties"])
    if extra:
        return f"{call.name} takes no argument {sorted(extra)[0]!r}"
    return None


def truncate(text: str, limit: int) -> str:
    """Keep the head and the tail, which hold the most useful lines of a long output."""
    if len(text) <= limit:
        return text
    marker = f"\n...[{len(text) - limit} characters cut]...\n"
    keep = max(limit - len(marker), 0)
    return text[: keep // 2] + marker + text[len(text) - (keep - keep // 2):]


def command_report(result: SandboxResult) -> str:
    """What the agent sees of a shell command: how it ended, then its output."""
    if result.status == "timed_out":
        head = "timed out (killed)"
    elif result.limit_hit is not None:
        head = f"stopped: the {result.limit_hit} limit"
    else:
        head = f"exit code {result.exit_code}"
    return "\n".join([head, *(t for t in (result.stdout_tail, result.stderr_tail) if t)])


@dataclass
class ToolResult:
    observation: str
    done: bool = False
    tests: SandboxResult | None = None  # set by run_tests


@dataclass
class ToolWorkspace:
    """A rollout's private directory holding the task's files and `solution.py`. `runner`
    runs its sandbox jobs (the tests, shell commands): the local sandbox by default, or the
    sandbox fleet's (`simulate.sandbox_service.sandbox_runner`)."""

    root: Path
    task: Task
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    runner: Callable[[SandboxJob], SandboxResult] = run_sandboxed
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

    def run(self, call: ToolCall) -> ToolResult:
        """Check and run one call; every outcome is an observation."""
        why = check_call(call, self.task.tools)
        if why is not None:
            return self._reply(f"error: {why}")
        if self.finished:
            return self._reply("error: the episode is finished", done=True)
        return self.execute(call)

    def execute(self, call: ToolCall) -> ToolResult:
        if call.name == "run_tests":
            return self.run_tests()
        if call.name == "finish":
            self.finished = True
            return self._reply("finished", done=True)
        if call.name == "list_files":
            return self._reply("\n".join(self.files()) or "no files")
        if call.name == "search":
            return self.search(call.arguments["text"])
        if call.name == "run":
            return self.run_command(call.arguments["command"])
        path = call.arguments["path"]
        target = self._resolve(path)
        if target is None:
            return self._reply(f"error: path {path!r} is outside the workspace")
        if call.name == "read_file":
            if not target.is_file():
                return self._reply(f"error: no such file {path}")
            return self._reply(target.read_text(errors="replace"))
        if call.name == "write_file":
            content = call.arguments["content"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
            return self._reply(f"wrote {len(content)} characters to {path}")
        return self._apply_edit(target, path, call.arguments["old"], call.arguments["new"])

    def files(self) -> dict[str, str]:
        """Every text file of the workspace, by relative path."""
        return {str(p.relative_to(self.root)): p.read_text(errors="replace")
                for p in sorted(self.root.rglob("*")) if p.is_file()}

    def sandbox_job(self) -> SandboxJob:
        """`solution.py` is the candidate; the other files travel with it."""
        files = self.files()
        return SandboxJob(code=files.pop(SOLUTION_FILE, ""), tests=self.task.tests,
                          entry_point=self.task.entry_point, files=files, limits=self.limits)

    def search(self, text: str) -> ToolResult:
        """`path:line: content` of every line holding `text` (plain text, case-sensitive), at
        most `MAX_MATCHES`."""
        if not text:
            return self._reply("error: search needs text to find")
        hits = [f"{path}:{number}: {line}" for path, content in self.files().items()
                for number, line in enumerate(content.splitlines(), start=1) if text in line]
        more = f"\n...and {len(hits) - MAX_MATCHES} more" if len(hits) > MAX_MATCHES else ""
        return self._reply("\n".join(hits[:MAX_MATCHES]) + more if hits else "no match")

    def command_job(self, command: str) -> SandboxJob:
        """`command` in the sandbox, on a copy of the workspace's files."""
        return SandboxJob(files=self.files(), command=command, limits=self.limits)

    def run_command(self, command: str) -> ToolResult:
        return self._reply(command_report(self.runner(self.command_job(command))))

    def run_tests(self) -> ToolResult:
        result = self.runner(self.sandbox_job())
        lines = [f"{result.status}: {result.tests_passed or 0}/{result.tests_total or 0} tests "
                 f"passed", *result.failures]
        if result.stdout_tail or result.stderr_tail:
            lines += ["output:", result.stdout_tail + result.stderr_tail]
        return self._reply("\n".join(lines), tests=result)

    def _apply_edit(self, target: Path, path: str, old: str, new: str) -> ToolResult:
        if not target.is_file():
            return self._reply(f"error: no such file {path}")
        text = target.read_text()
        if not old or text.count(old) != 1:
            found = "empty" if not old else "not found" if old not in text \
                else "found more than once"
            return self._reply(f"error: old text {found} in {path}; nothing changed")
        target.write_text(text.replace(old, new))
        return self._reply(f"edited {path}")

    def _resolve(self, relative: str) -> Path | None:
        target = (self.root / relative).resolve()
        return target if target.is_relative_to(self.root) and target != self.root else None

    def _reply(self, text: str, *, done: bool = False,
               tests: SandboxResult | None = None) -> ToolResult:
        return ToolResult(truncate(text, self.max_observation_chars), done=done, tests=tests)
