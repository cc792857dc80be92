"""bench/vs_trl.py's pieces: TRL sees the harness's first-turn prompt, is scored by the same
sandboxed tests, and stops at the wall time. The TRL run skips when the bench extra is absent."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from app.settings import Settings
from simulate.demonstrations import demonstration_call
from simulate.rollouts import SYSTEM_PROMPT, SandboxCache
from simulate.tasks import BuiltinTasksConfig, Task, build_task_source
from simulate.tools import ToolCall, render_call

BENCH = Path(__file__).resolve().parents[2] / "bench" / "vs_trl.py"


@pytest.fixture(scope="module")
def vs_trl() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_vs_trl", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train() -> list[Task]:
    return build_task_source(BuiltinTasksConfig()).split("train")


def test_reward_runs_the_first_turn_tool_call_against_the_tests(
        vs_trl: ModuleType, train: list[Task], tmp_path: Path) -> None:
    task = train[0]
    reward = vs_trl.FirstTurnReward(train, SandboxCache(), tmp_path)
    right = render_call(demonstration_call(task))
    wrong = render_call(ToolCall("write_file", {"path": "solution.py",
                                                "content": f"{task.prompt}    return None\n"}))
    scores = reward([right, wrong, "no tool call at all"], task_id=[task.task_id] * 3,
                    prompts=["p"] * 3)
    assert scores == [1.0, 0.0, 0.0]
    assert reward.scored == 3


def test_prompt_text_is_the_harness_first_turn(vs_trl: ModuleType, train: list[Task],
                                               model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from simulate.harness import ChatTokens

    chat = ChatTokens(AutoTokenizer.from_pretrained(model_dir))
    text = vs_trl.first_turn_prompt(chat, train[0])
    assert text.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}\n<tools>")
    assert text.endswith(f"{train[0].starting_file}<|im_end|>\n<|im_start|>assistant\n")


def test_trl_grpo_stops_at_the_wall_time(vs_trl: ModuleType, train: list[Task],
                                         model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("trl", reason="TRL is the bench extra: pip install -e '.[bench]'")
    from trainer.policy import Policy

    cfg = Settings().bootstrap.model_copy(update={
        "group_size": 2, "groups_per_step": 1, "max_tokens": 8, "max_steps": 5})
    policy = Policy.load(model_dir, lr=cfg.lr)
    run = vs_trl.run_trl(policy.model, policy.tokenizer, cfg, train[:4], seconds=0.0,
                         threads=1, workdir=tmp_path)
    assert run.steps == 1  # a zero budget ends the loop after its first step
    assert run.samples == 2 and 0.0 <= run.rewards[0] <= 1.0 and run.wall_s > 0
