"""The harness on the real tiny model: the chat template token by token, loss mask, logprobs,
parsed calls, summarization."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ingest.events import decode, encode
from ingest.rollout_events import RolloutGroup
from simulate.harness import SUMMARY_PREFIX, ChatTokens, Harness, HarnessConfig, model_tokens
from simulate.rollouts import (
    SYSTEM_PROMPT,
    SandboxCache,
    TaskEnvironment,
    pack_trajectory,
    rollout_group,
    unpack_segments,
)
from simulate.tasks import BuiltinTaskSource
from simulate.tools import TOOLS, ToolCall, render_call


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    from serving.torch_engine import TorchEngine

    e = TorchEngine.load(model_dir, seed=0, threads=1)
    yield e
    e.close()


@pytest.fixture(scope="module")
def task():
    return next(t for t in BuiltinTaskSource(0.2).tasks() if t.task_id == "builtin/add_3")


def test_chat_prompt_is_chatml(engine) -> None:
    chat = ChatTokens(engine.tokenizer)
    ids = chat.prompt("sys", "do it")
    text = engine.tokenizer.decode(ids)
    assert text == ("<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\ndo it<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_pieces_are_the_ids_the_server_renders(engine) -> None:
    """A conversation with calls and results, built piece by piece, is token for token the
    template's rendering of it tokenized whole, as the server does."""
    tok, chat = engine.tokenizer, ChatTokens(engine.tokenizer)
    call = ToolCall("read_file", {"path": "solution.py"}, "call_1")

    built = chat.prompt("sys", "do it", tools=TOOLS) + chat.encode(render_call(call)) + [
        chat.im_end] + chat.newline + chat.tool_results(["def f(): pass"]) + chat.open(
        "assistant")
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "do it"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type":
                 "function", "function": {"name": "read_file", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "def f(): pass"}]
    served = tok(tok.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                         add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    assert built == served


def test_episode_masks_model_tokens_only(engine, task, tmp_path: Path) -> None:
    chat = ChatTokens(engine.tokenizer)
    harness = Harness.on_engine(engine, HarnessConfig(max_turns=2, max_tokens=12))
    env = TaskEnvironment(task, tmp_path / "w", SandboxCache())
    traj = asyncio.run(harness.run(env, task_id=task.task_id, seed=1))
    (seg,) = traj.segments
    assert len(seg.token_ids) == len(seg.loss_mask) == len(seg.logprobs)
    assert traj.turns == 2 and len(traj.texts) == 2
    prompt = chat.prompt(SYSTEM_PROMPT, task.starting_file, tools=TOOLS)
    assert seg.token_ids[:len(prompt)] == prompt and not any(seg.loss_mask[:len(prompt)])
    # every model span ends at <|im_end|> or at max_tokens; observations are mask 0
    assert all(lp < 0 for lp, m in zip(seg.logprobs, seg.loss_mask, strict=True) if m)
    assert all(lp == 0 for lp, m in zip(seg.logprobs, seg.loss_mask, strict=True) if not m)
    observation = engine.tokenizer.decode([t for t, m in zip(seg.token_ids, seg.loss_mask,
                                                             strict=True) if not m])
    # an untrained model makes no call: the harness asked for one between the turns
    assert "error: no tool call" in observation
    assert 0 < model_tokens(traj) <= 24
    assert traj.reward == env.reward().value


def test_self_summarization_starts_a_fresh_context(engine, task, tmp_path: Path) -> None:
    chat = ChatTokens(engine.tokenizer)
    harness = Harness.on_engine(engine, HarnessConfig(max_turns=3, max_tokens=10,
                                                  context_budget=40, max_summaries=1))
    env = TaskEnvironment(task, tmp_path / "w", SandboxCache())
    traj = asyncio.run(harness.run(env, task_id=task.task_id, seed=2))
    assert traj.summaries == 1 and len(traj.segments) == 2
    first, second = traj.segments
    assert "Summarize your progress" in engine.tokenizer.decode(first.token_ids)
    assert first.loss_mask[-2] == 1 or first.loss_mask[-3] == 1  # summary tokens are trained
    assert SUMMARY_PREFIX in engine.tokenizer.decode(second.token_ids)
    opening = chat.prompt(SYSTEM_PROMPT, task.starting_file, tools=TOOLS)
    assert second.token_ids[:len(opening) - len(chat.open("assistant"))] == \
        opening[:-len(chat.open("assistant"))]
    packed = pack_trajectory(traj)
    assert [s.token_ids for s in unpack_segments(packed)] == [first.token_ids, second.token_ids]


def test_an_episode_whose_context_fills_ends_by_its_context(engine, task,
                                                            tmp_path: Path) -> None:
    """Summaries used up, the window grows to the model's context: the episode ends there,
    with its reason and its reward, instead of the engine's error; its routes travel with it,
    no route (-1) after the last engine call."""
    from simulate.rollouts import episode_shape

    harness = Harness.on_engine(engine, HarnessConfig(max_turns=100, max_tokens=256,
                                                      context_budget=600, max_summaries=1))
    env = TaskEnvironment(task, tmp_path / "w", SandboxCache())
    traj = asyncio.run(harness.run(env, task_id=task.task_id, seed=3))
    assert traj.ended_by == "context" and traj.summaries == 1 and not traj.finished
    assert len(traj.segments[-1]) >= engine.max_context - 2  # the closing tag and newline
    assert traj.reward == env.reward().value
    packed = pack_trajectory(traj)
    assert packed.ended_by == "context"
    shape = episode_shape([packed])
    assert shape["ended_by_context"] == 1.0 and shape["summaries_per_episode"] == 1.0
    assert shape["turns_per_episode"] == traj.turns
    if packed.routed_experts is not None:
        routes = [s.routes for s in unpack_segments(packed)]
        assert all(r is not None and r.shape[0] == len(s) for r, s in
                   zip(routes, traj.segments, strict=True))
        assert (routes[-1][-1] == -1).all()  # the newline after the last call: no route


def test_environment_rewards_a_correct_write(task, tmp_path: Path) -> None:
    env = TaskEnvironment(task, tmp_path / "w", SandboxCache())
    assert env.reward().value == 0.0  # the prompt alone has no body
    write = ToolCall("write_file", {"path": "solution.py",
                                    "content": task.prompt + (task.canonical_solution or "")})
    (obs,), done = env.step([write])
    assert not done and "wrote" in obs
    (obs,), done = env.step([ToolCall("run_tests")])
    assert obs.startswith("passed: 4/4") and not done
    assert env.step([ToolCall("finish")])[1] and env.reward().value == 1.0


def test_group_travels_as_wire_type(engine, task, tmp_path: Path) -> None:
    harness = Harness.on_engine(engine, HarnessConfig(max_turns=1, max_tokens=6))
    group = asyncio.run(rollout_group(harness, task, group_size=3, cache=SandboxCache(),
                                      workdir=tmp_path, seed=0))
    assert len(group.trajectories) == 3 and group.policy_version == engine.version.number
    again = decode(RolloutGroup, encode(group))
    assert again.trajectories[0].token_ids.tolist() == group.trajectories[0].token_ids.tolist()
    if group.trajectories[0].routed_experts is not None:
        assert group.trajectories[0].routed_experts.shape[0] == len(group.trajectories[0].token_ids)


def test_a_groups_episodes_are_scored_by_the_rewards_it_is_given(
        engine, task, tmp_path: Path, judge_url: str) -> None:
    """The scoring a rollout job carries reaches every episode: with a judge weighted as the
    tests, an episode the tiny random model leaves unsolved earns half the judge's 0.7."""
    from simulate.rewards import JudgeConfig, RewardConfig
    from tests.simulate.conftest import FakeJudge

    rewards = RewardConfig(judge_weight=1.0, judge=JudgeConfig(base_url=judge_url, model="j"))
    harness = Harness.on_engine(engine, HarnessConfig(max_turns=1, max_tokens=6))
    group = asyncio.run(rollout_group(harness, task, group_size=2, cache=SandboxCache(),
                                      workdir=tmp_path, seed=0, rewards=rewards))
    clean = [t for t in group.trajectories if not t.flags]
    assert clean and all(t.reward == pytest.approx(0.35) for t in clean)
    assert len(FakeJudge.received) == len(clean)
