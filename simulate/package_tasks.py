"""Long tasks: a small package with a bug in two of its modules and a failing test to read first.

The one-line tasks of `simulate.tasks` are solved in one edit. These take reading before
writing, the way a repository's bugs do: the package `pkg/` holds a settings module and a
module using it; each has one constant wrong, and `tests/test_<name>.py` says what every
constant must be and what the function must return. A good episode lists the files, reads
the test, reads each module, fixes its line, runs the tests after each fix (the first fix
passes some of them), and finishes: 9 turns, past the default context budget of the
coding agent's tools (simulate/tools.py CODING_TOOLS) halfway through, so the harness's
self-summarization fires (simulate/harness.py).

Each family is a template over four parameters (the two right values and the two wrong
ones); `package_specs()` fills every family with its parameter grid, in a fixed order, and
`practice_specs()` the seen families with values no task takes, for mid-training (copying a
value from the test, not recalling one, is what fits them).
`simulate.tasks.BuiltinTaskSource` makes them tasks (`BuiltinTasksConfig.packages`), split by
task id like the one-line tasks, and by family for `held_out_family`; `Task.fixes` holds the
two edits that solve one, from which `simulate/demonstrations.py` writes its episode.
"""

from __future__ import annotations

from dataclasses import dataclass

TURNS = 16  # a package task's turn limit: the demonstration's 9 and room for detours
UNSEEN_PACKAGES = "pkg_window"  # the family held out whole (`held_out_family`)


@dataclass(frozen=True)
class Family:
    """`settings` names the module holding `first` (its right value must be copied from the
    test); `module` the one holding `second` and the function `function` of one argument
    `arg`, whose body is `expression` over the two constants. Values are ints, or strings
    when `text`."""

    name: str
    settings: str
    first: str
    module: str
    second: str
    function: str
    arg: str
    expression: str
    examples: tuple[object, ...]
    text: bool = False


FAMILIES = (
    Family("pkg_scale", "config", "FACTOR", "convert", "OFFSET", "convert", "x",
           "x * FACTOR + OFFSET", (0, 2, 5, 10)),
    Family("pkg_clip", "limits", "LOW", "clip", "HIGH", "clip", "x",
           "max(LOW, min(HIGH, x))", (-50, 0, 5, 50)),
    Family("pkg_price", "rates", "RATE", "billing", "FEE", "price", "n", "n * RATE + FEE",
           (0, 1, 3, 12)),
    Family("pkg_label", "names", "PREFIX", "labels", "SUFFIX", "label", "s",
           "PREFIX + s + SUFFIX", ("", "ok", "x", "abc"), text=True),
    Family("pkg_window", "bounds", "START", "window", "SIZE", "window", "xs",
           "xs[START:START + SIZE]", ([1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 0, 0, 0, 0, 0, 0])),
)
_INTS = (2, 3, 4, 5, 6, 7, 8, 9)
_WORDS = ("ab", "cd", "ef", "gh", "ij", "kl")
# values no task takes, for mid-training's practice tasks: copying a value, not recalling one
_PRACTICE_INTS = (11, 12, 13, 14, 15, 16, 17, 18)
_PRACTICE_WORDS = ("mn", "op", "qr", "st", "uv", "wx")


@dataclass(frozen=True)
class PackageSpec:
    """One package task: its files, hidden tests (the visible test file's), the two edits
    that solve it (path, old line, new line) and its entry point."""

    task_id: str
    family: str
    prompt: str
    files: dict[str, str]
    tests: str
    fixes: tuple[tuple[str, str, str], ...]
    entry_point: str


def _values(family: Family, *, practice: bool = False
            ) -> list[tuple[object, object, object, object]]:
    """(first, wrong first, second, wrong second) for every task of `family`: each value of
    its pool right for the first constant twice, beside two others for the second; a wrong
    value is the pool's next."""
    pool: tuple[object, ...] = ((_PRACTICE_WORDS if practice else _WORDS) if family.text
                                else _PRACTICE_INTS if practice else _INTS)
    if family.name == UNSEEN_PACKAGES:
        pool = (1, 2, 3, 4)
    n = len(pool)
    pairs = [(a, pool[(i + 1) % n]) for i, a in enumerate(pool)]
    return [(*pairs[i], *pairs[(i + k) % n]) for k in (1, 3) for i in range(n)]


def _spec(family: Family, first: object, wrong_first: object, second: object,
          wrong_second: object, *, kind: str = "package") -> PackageSpec:
    f = family
    name = f"{f.name}_{first}_{second}"
    settings_path, module_path = f"pkg/{f.settings}.py", f"pkg/{f.module}.py"
    test_path = f"tests/test_{f.module}.py"
    settings = (f'"""Settings of the package."""\n\nNAME = "pkg"\nVERSION = "1.4"\n'
                f'AUTHOR = "flywheel"\nDEBUG = False\nVERBOSE = False\nRETRIES = 3\n'
                f'TIMEOUT = 30\nENCODING = "utf-8"\nCACHE_SIZE = 128\nMAX_ITEMS = 1000\n'
                f'{f.first} = {wrong_first!r}\nLOG_LEVEL = "info"\nLOG_FILE = "pkg.log"\n'
                f'COLOR = True\nLANGUAGE = "en"\n')
    module = (f'"""{f.function.capitalize()} values with the package settings."""\n\n'
              f"from pkg.{f.settings} import {f.first}, NAME\n\n"
              f"{f.second} = {wrong_second!r}\n\n\n"
              f"def {f.function}({f.arg}):\n    return {f.expression}\n\n\n"
              f"def describe():\n    return NAME + '.{f.function} uses {f.first} and "
              f"{f.second}'\n\n\n"
              f"def {f.function}_all(items):\n    return [{f.function}(item) for item in items]\n")
    namespace: dict[str, object] = {f.first: first, f.second: second}
    expected = [eval(f.expression, namespace, {f.arg: x}) for x in f.examples]  # noqa: S307
    tests = (f'"""Tests of pkg.{f.module}: the settings it reads and what it returns."""\n\n'
             f"from pkg.{f.settings} import {f.first}\n"
             f"from pkg.{f.module} import {f.second}, {f.function}\n\n\n"
             f"def test_{f.first.lower()}():\n    assert {f.first} == {first!r}\n\n\n"
             f"def test_{f.second.lower()}():\n    assert {f.second} == {second!r}\n")
    tests += "".join(f"\n\ndef test_{f.function}_{i}():\n    assert {f.function}({x!r}) == "
                     f"{y!r}\n" for i, (x, y) in enumerate(zip(f.examples, expected,
                                                                strict=True)))
    files = {"README.md": f"# pkg\n\nA small package: `{f.function}` and its settings.\n",
             "setup.cfg": "[metadata]\nname = pkg\nversion = 1.4\n",
             "pkg/__init__.py": '"""pkg."""\n', "pkg/version.py": '__version__ = "1.4"\n',
             settings_path: settings, module_path: module, test_path: tests}
    fixes = ((settings_path, f"{f.first} = {wrong_first!r}", f"{f.first} = {first!r}"),
             (module_path, f"{f.second} = {wrong_second!r}", f"{f.second} = {second!r}"))
    prompt = f"# The tests in {test_path} fail. Fix the package pkg so that they pass.\n"
    return PackageSpec(f"{kind}/{name}", f.name, prompt, files, tests, fixes, f.function)


def package_specs() -> list[PackageSpec]:
    """Every package task, family by family, in a fixed order."""
    return [_spec(f, *values) for f in FAMILIES for values in _values(f)]


def practice_specs() -> list[PackageSpec]:
    """The seen families with values no task takes (`package-practice/...`), for
    mid-training."""
    return [_spec(f, *values, kind="package-practice") for f in FAMILIES
            if f.name != UNSEEN_PACKAGES for values in _values(f, practice=True)]
