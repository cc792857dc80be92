"""Mid-training demonstrations: every one solves its task, and only assistant turns are trained."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulate.demonstrations import demonstration_call, transcript
from simulate.harness import ChatTokens
from simulate.rollouts import SYSTEM_PROMPT, SandboxCache, TaskEnvironment
from simulate.tasks import BuiltinTasksConfig, HumanEvalConfig, build_task_source
from simulate.tools import TOOLS, ToolCall, calls_in, render_call


def test_demonstrations_solve_their_tasks(tmp_path: Path) -> None:
    builtin = build_task_source(BuiltinTasksConfig()).tasks()
    humaneval = build_task_source(HumanEvalConfig()).tasks()
    cache = SandboxCache()
    for i, task in enumerate(builtin[::9] + humaneval[:3]):
        env = TaskEnvironment(task, tmp_path / str(i), cache)
        (observation,), done = env.step([demonstration_call(task)])
        assert not done and not observation.startswith("error"), (task.task_id, observation)
        assert env.reward().value == 1.0, task.task_id


def test_builtin_demonstration_edits_the_stub() -> None:
    task = build_task_source(BuiltinTasksConfig()).tasks()[0]
    assert task.starting_file.endswith("    pass\n")
    call = demonstration_call(task)
    assert (call.name, call.arguments["old"]) == ("apply_edit", "    pass")


def test_transcript_trains_assistant_turns_only(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    chat = ChatTokens(AutoTokenizer.from_pretrained(model_dir))
    task = build_task_source(BuiltinTasksConfig()).tasks()[3]
    ids, mask = transcript(chat, task)
    prompt = chat.prompt(SYSTEM_PROMPT, task.starting_file, tools=TOOLS)
    assert ids[:len(prompt)] == prompt and not any(mask[:len(prompt)])
    trained = chat.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained == "".join(render_call(c) for c in (
        demonstration_call(task), ToolCall("run_tests"), ToolCall("finish")))
    assert [c.name for c in calls_in(trained)] == ["apply_edit", "run_tests", "finish"]
    untrained = chat.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert "<tool_response>\nedited solution.py\n</tool_response>" in untrained
    assert "passed: 4/4" in untrained


def test_practice_tasks_split_between_mid_training_and_grpo() -> None:
    from simulate.tasks import BuiltinTasksConfig, build_task_source
    from trainer.bootstrap.config import BootstrapSettings
    from trainer.bootstrap.midtrain import corpus_tasks, rl_tasks, validation_tasks

    source = build_task_source(BuiltinTasksConfig())
    train, practice = source.split("train"), source.practice_tasks()
    held_out = {t.task_id for t in source.split("held_out") + source.split("product")}
    cfg = BootstrapSettings(grpo_practice_fraction=0.25)
    corpus, pool = corpus_tasks(cfg, source, train), rl_tasks(cfg, source, train)
    validation = {t.task_id for t in validation_tasks(cfg, source)}
    reserved = {t.task_id for t in pool} - {t.task_id for t in train}
    assert not reserved & {t.task_id for t in corpus}  # GRPO's practice is unseen
    assert len(validation) == cfg.validation_tasks  # ...and the validation tasks are neither's
    assert not validation & ({t.task_id for t in corpus} | reserved)
    assert len(corpus) + len(pool) + len(validation) == 2 * len(train) + len(practice)
    assert 0.15 < (len(reserved) + len(validation)) / len(practice) < 0.35
    assert not ({t.task_id for t in corpus} | reserved | validation) & held_out
    assert rl_tasks(BootstrapSettings(grpo_practice_fraction=0.0), source, train) == train
    assert corpus_tasks(BootstrapSettings(midtrain_practice=False), source, train) == train


def test_lr_floor_one_holds_the_rate_after_warm_up() -> None:
    from trainer.bootstrap.midtrain import lr_factor

    assert [lr_factor(s, 100, floor=1.0) for s in (0, 9, 10, 50, 99)] == [0.1, 1.0, 1.0, 1.0, 1.0]
    assert lr_factor(99, 100) < 0.2  # the default still decays


def test_cosine_factor_runs_from_one_to_the_floor_and_stays() -> None:
    """GRPO's schedule (`lr_floor`): progress is the run's fraction of its budget."""
    from trainer.bootstrap.midtrain import cosine_factor

    assert cosine_factor(0.0, floor=0.1) == 1.0
    assert cosine_factor(0.5, floor=0.1) == pytest.approx(0.55)
    assert cosine_factor(1.0, floor=0.1) == cosine_factor(1.7, floor=0.1) == pytest.approx(0.1)
    assert cosine_factor(0.3, floor=1.0) == 1.0


def test_written_probability_is_the_product_of_the_masked_tokens_probabilities(
        model_dir: Path) -> None:
    import torch

    from trainer.policy import Policy, Rows

    policy = Policy.load(model_dir, lr=1e-3)
    rows = Rows([[5, 6, 7, 8, 9], [5, 6, 7]], [[0, 0, 1, 1, 0], [0, 1, 1]])
    written = policy.written_probability(rows, 0.7)
    with torch.no_grad():
        logits = policy.model(input_ids=torch.tensor([[5, 6, 7, 8, 9]])).logits[0].double()
    logp = (logits / 0.7).log_softmax(-1)  # position t predicts token t + 1
    expected = [float((logp[1, 7] + logp[2, 8]).exp()), float((logp[0, 6] + logp[1, 7]).exp())]
    assert written == pytest.approx(expected, rel=1e-4)


def test_midtraining_stops_at_the_first_check_that_reaches_its_target(model_dir: Path) -> None:
    import dataclasses

    from trainer.bootstrap.config import BootstrapSettings
    from trainer.bootstrap.midtrain import corpus_tasks, midtrain, quality_stop
    from trainer.policy import Policy

    source = build_task_source(BuiltinTasksConfig())
    train = source.split("train")
    cfg = BootstrapSettings(midtrain_until=0.3)
    stop = quality_stop(cfg, source)
    assert stop is not None and (stop.target, stop.every) == (0.3, 25)
    unseen = {t.task_id for t in stop.tasks}  # copying, not recall: none is trained on
    assert unseen and not unseen & {t.task_id for t in corpus_tasks(cfg, source, train)}
    assert quality_stop(BootstrapSettings(), source) is None

    policy = Policy.load(model_dir, lr=1e-3)
    chat = ChatTokens(policy.tokenizer)
    never = dataclasses.replace(stop, tasks=stop.tasks[:3], target=1.0, every=2)
    result = midtrain(policy, chat, train[:8], steps=5, batch_size=2, lr=1e-3, stop=never)
    assert result.steps == 5 and [step for step, _ in result.checks] == [2, 4]
    assert all(0.0 < p < 1.0 for _, p in result.checks)
    reached = dataclasses.replace(never, target=1e-300)
    result = midtrain(policy, chat, train[:8], steps=5, batch_size=2, lr=1e-3, stop=reached)
    assert result.steps == 2 and len(result.checks) == 1 and policy.version == 0


def test_a_weighted_family_is_drawn_that_many_times_as_often(model_dir: Path) -> None:
    import random

    from transformers import AutoTokenizer

    from simulate.task_templates import LETTER_FAMILIES
    from trainer.bootstrap.config import BootstrapSettings
    from trainer.bootstrap.midtrain import DemonstrationCorpus

    assert {"count_char_{p}", "append_char_{p}", "prepend_char_{p}"} <= set(LETTER_FAMILIES)
    assert "add_{p}" not in LETTER_FAMILIES
    # `flywheel bootstrap` weighs the letter templates by default (the last values copied)
    assert BootstrapSettings().midtrain_family_weights == dict.fromkeys(LETTER_FAMILIES, 4.0)
    chat = ChatTokens(AutoTokenizer.from_pretrained(model_dir))
    tasks = build_task_source(BuiltinTasksConfig()).split("train")
    letters = [t for t in tasks if t.family == "count_char_{p}"][:5]
    others = [t for t in tasks if t.family == "add_{p}"][:5]
    corpus = DemonstrationCorpus.of(chat, letters + others,
                                    family_weights={"count_char_{p}": 4.0})
    assert corpus.cumulative == [4.0, 8.0, 12.0, 16.0, 20.0, 21.0, 22.0, 23.0, 24.0, 25.0]
    letter_ids = {tuple(ids) for ids, _ in corpus.windows[:5]}
    drawn = corpus.draw(random.Random(0), 4000)
    share = sum(tuple(ids) in letter_ids for ids in drawn.sequences) / 4000
    assert share == pytest.approx(0.8, abs=0.03)  # 4 x 5 against 1 x 5
    unweighted = DemonstrationCorpus.of(chat, letters + others, family_weights={})
    assert unweighted.cumulative is None
    share = sum(tuple(ids) in letter_ids
                for ids in unweighted.draw(random.Random(0), 4000).sequences) / 4000
    assert share == pytest.approx(0.5, abs=0.03)
    # unweighted, the draws are those mid-training made before there were weights
    rng = random.Random(7)
    before = [unweighted.windows[rng.randrange(10)][0] for _ in range(6)]
    assert unweighted.draw(random.Random(7), 6).sequences == before
