"""Mid-training demonstrations: every one solves its task, and only assistant turns are trained."""

from __future__ import annotations

from pathlib import Path

from simulate.harness import ChatTokens
from simulate.rollouts import SYSTEM_PROMPT, SandboxCache, TaskEnvironment
from simulate.tasks import BuiltinTasksConfig, HumanEvalConfig, build_task_source
from trainer.midtrain import demonstration_call, transcript


def test_demonstrations_solve_their_tasks(tmp_path: Path) -> None:
    builtin = build_task_source(BuiltinTasksConfig()).tasks()
    humaneval = build_task_source(HumanEvalConfig()).tasks()
    cache = SandboxCache()
    for i, task in enumerate(builtin[::9] + humaneval[:3]):
        env = TaskEnvironment(task, tmp_path / str(i), cache)
        observation, done = env.step(demonstration_call(task))
        assert not done and not observation.startswith("error"), (task.task_id, observation)
        assert env.reward() == 1.0, task.task_id


def test_builtin_demonstration_edits_the_stub() -> None:
    task = build_task_source(BuiltinTasksConfig()).tasks()[0]
    assert task.starting_file.endswith("    pass\n")
    assert demonstration_call(task).startswith("<tool>apply_edit solution.py\n<<<\n    pass\n")


def test_transcript_trains_assistant_turns_only(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    chat = ChatTokens(AutoTokenizer.from_pretrained(model_dir))
    task = build_task_source(BuiltinTasksConfig()).tasks()[3]
    ids, mask = transcript(chat, task)
    prompt = chat.prompt(SYSTEM_PROMPT, task.starting_file)
    assert ids[:len(prompt)] == prompt and not any(mask[:len(prompt)])
    trained = chat.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained == (demonstration_call(task) + "<tool>run_tests</tool><tool>finish</tool>")
    untrained = chat.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert "applied 1 edit(s) to solution.py" in untrained and "passed: 4/4" in untrained
