"""Flywheel's pipelined GRPO vs TRL's `GRPOTrainer`: same start, tasks, group size, wall time.

Both sides start from one mid-trained copy of the same weights, train on the built-in train
tasks with G = `bootstrap.group_size` samples per task and `groups_per_step` tasks per optimizer
step, at the same temperature, tokens per model turn, learning rate and ratio clip, for the same
wall time, with the same `torch.set_num_threads`.

The episodes differ: Flywheel's are multi-turn (apply_edit, run_tests, finish, up to
`max_turns` model turns, `simulate/harness.py`); TRL's GRPOTrainer samples one completion per
prompt, so its episode is the harness's first turn only: the same ChatML prompt tokens, the
tool call parsed by `simulate/tools.py`, the workspace scored by the same `TaskEnvironment`
reward in the same sandbox. So the common units are:

- throughput: tokens sampled by the policy per second of training-loop wall time, in the
  episodes that reached an optimizer step (a TRL sample is one turn, a Flywheel episode
  several); samples/s is printed beside it;
- reward: each final policy's expected reward on one fixed list of train tasks, measured the
  same way for both (`trainer.bootstrap.local_engine.mean_reward`: the product's multi-turn
  episode, seeded, at the training temperature), and its greedy held-out pass@1. The
  training curves (reward per step against wall time) are printed and plotted, but their
  rewards are each side's own episode.

    pip install -e '.[bench]'        # TRL and its dependencies (make bench does this)
    .venv/bin/python bench/vs_trl.py --seconds 120 [--model-dir data/models/base]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.settings import Settings  # noqa: E402
from simulate.tasks import Task  # noqa: E402
from trainer.bootstrap.config import BootstrapSettings  # noqa: E402

TRL_MISSING = ("bench/vs_trl.py needs TRL, which the default install leaves out: "
               "pip install -e '.[bench]'  (or: make bench)")
END_STEPS = 5  # the end points of a reward curve: the mean of its first / last 5 steps
REWARD_TASKS, REWARD_SAMPLES = 32, 4  # the fixed measure of a final policy's reward


def first_turn_prompt(chat: Any, task: Task) -> str:
    """The harness's first-turn context as text that tokenizes back to the very same ids."""
    from simulate.rollouts import SYSTEM_PROMPT
    from simulate.tools import TOOLS

    ids = chat.prompt(SYSTEM_PROMPT, task.starting_file, tools=TOOLS)
    text = str(chat.tokenizer.decode(ids, skip_special_tokens=False))
    again = list(chat.tokenizer(text, add_special_tokens=False)["input_ids"])
    if again != ids:
        raise ValueError(f"{task.task_id}: the prompt text does not tokenize back to the "
                         "harness's ids, so TRL would see a different prompt")
    return text


class FirstTurnReward:
    """TRL reward function: run each completion as the harness's first turn, then score the
    workspace exactly as `TaskEnvironment.reward` does. Dataset columns arrive as kwargs."""

    __name__ = "tests_passed"

    def __init__(self, tasks: list[Task], cache: Any, workdir: Path) -> None:
        self.tasks = {t.task_id: t for t in tasks}
        self.cache = cache
        self.workdir = workdir
        self.scored = 0

    def __call__(self, completions: list[str], task_id: list[str], **_: Any) -> list[float]:
        from simulate.rollouts import TaskEnvironment
        from simulate.tools import calls_in

        rewards = []
        with tempfile.TemporaryDirectory(dir=self.workdir, prefix="trl-") as tmp:
            for i, (text, tid) in enumerate(zip(completions, task_id, strict=True)):
                env = TaskEnvironment(self.tasks[tid], Path(tmp) / str(i), self.cache)
                env.step(calls_in(text))
                rewards.append(env.reward().value)
        self.scored += len(rewards)
        return rewards


@dataclass
class TrlRun:
    rewards: list[float] = field(default_factory=list)  # one per optimizer step
    times: list[float] = field(default_factory=list)  # loop wall time at each step's log
    samples: int = 0
    tokens: int = 0  # completion tokens sampled in the trained batches
    wall_s: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.rewards)

    @property
    def samples_per_s(self) -> float:
        return self.samples / max(1e-9, self.wall_s)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(1e-9, self.wall_s)


def curve_ends(rewards: list[float]) -> tuple[float, float]:
    """(mean of the first END_STEPS rewards, mean of the last END_STEPS)."""
    head, tail = rewards[:END_STEPS], rewards[-END_STEPS:]
    return sum(head) / max(1, len(head)), sum(tail) / max(1, len(tail))


def run_trl(model: Any, tokenizer: Any, cfg: BootstrapSettings, train: list[Task], *,
            seconds: float, threads: int, workdir: Path) -> TrlRun:
    """TRL's GRPOTrainer on CPU until `seconds` of training-loop wall time have passed."""
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from simulate.harness import ChatTokens
    from simulate.rollouts import SandboxCache

    # transformers' own deprecation notices, raised by TRL's config and model set-up
    warnings.filterwarnings("ignore", message=r".*gradient_checkpointing` is deprecated",
                            category=FutureWarning)
    chat = ChatTokens(tokenizer)
    dataset = Dataset.from_list([{"prompt": first_turn_prompt(chat, t), "task_id": t.task_id}
                                 for t in train])
    reward = FirstTurnReward(train, SandboxCache(), workdir)
    run = TrlRun()
    batch = cfg.groups_per_step * cfg.group_size  # completions per optimizer step

    class WallClock(TrainerCallback):  # type: ignore[misc]
        """Starts the clock with the loop, logs reward per step, stops at the deadline."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            torch.set_num_threads(threads)  # after accelerate's own set-up
            self.start = time.monotonic()

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
                   **kw: Any) -> None:
            if logs and "reward" in logs:
                run.rewards.append(float(logs["reward"]))
                run.times.append(time.monotonic() - self.start)
                run.tokens += round(float(logs.get("completions/mean_length", 0.0)) * batch)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if time.monotonic() - self.start > seconds:
                control.should_training_stop = True

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            run.wall_s = time.monotonic() - self.start

    config = GRPOConfig(
        output_dir=str(workdir / "trl-out"), use_cpu=True, bf16=False, fp16=False,
        report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True,
        gradient_checkpointing=False, seed=cfg.seed, max_steps=cfg.max_steps,
        # one optimizer step = groups_per_step tasks x group_size samples, as in Flywheel
        per_device_train_batch_size=cfg.groups_per_step * cfg.group_size,
        gradient_accumulation_steps=1, num_generations=cfg.group_size, num_iterations=1,
        max_completion_length=cfg.max_tokens, temperature=cfg.temperature, top_p=1.0,
        # Flywheel's optimizer and loss: AdamW(0.9, 0.99), constant lr, grad clip 1, token-level
        # clipped surrogate, group-std advantages, no KL, no MoE load-balancing loss
        learning_rate=cfg.lr, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0,
        epsilon=cfg.clip, beta=0.0, loss_type="dapo", scale_rewards="group",
        router_aux_loss_coef=0.0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[WallClock()])
    trainer.remove_callback(PrinterCallback)  # a dict per step on stdout; WallClock keeps reward
    trainer.train()
    run.samples = reward.scored  # every scored batch was trained on: the stop comes after a step
    return run


def plot_curves(fly: list[tuple[float, float]], trl: list[tuple[float, float]],
                path: Path) -> Path:
    """Both training curves, reward per step (a rolling mean of 5) against wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in (("flywheel (multi-turn episode)", fly),
                          ("trl (first turn only)", trl)):
        rewards = [r for _, r in points]
        smooth = [sum(rewards[max(0, i - 4):i + 1]) / len(rewards[max(0, i - 4):i + 1])
                  for i in range(len(rewards))]
        ax.plot([t for t, _ in points], smooth, label=label)
    ax.set(xlabel="training-loop wall time (s)", ylabel="rollout reward (rolling 5 steps)",
           ylim=(0, 1), title="GRPO from the same start: Flywheel vs TRL")
    ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def final_policy(policy: Any, cfg: BootstrapSettings, tasks: list[Task],
                 held_out: list[Task]) -> tuple[float, float]:
    """(expected multi-turn episode reward on `tasks`, greedy held-out pass@1) of a policy."""
    from simulate.rollouts import SandboxCache, pass_rate
    from trainer.bootstrap.local_engine import evaluate, make_engine, mean_reward

    cache = SandboxCache()
    reward = mean_reward(policy, cfg, tasks, samples=REWARD_SAMPLES, cache=cache)
    engine = make_engine(policy, cfg, seed=cfg.seed)
    try:
        held = pass_rate(evaluate(engine, cfg, held_out, cache))
    finally:
        engine.close()
    return reward, held


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=120.0, help="GRPO wall time per side")
    parser.add_argument("--midtrain-steps", type=int, help="default: bootstrap.midtrain_steps")
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--threads", type=int, help="torch threads, both sides "
                        "(default: bootstrap.torch_threads)")
    args = parser.parse_args(argv)
    try:  # up front: fail before the Flywheel side runs, never skip TRL's
        import trl
        from trl import GRPOTrainer  # noqa: F401  (trl imports its trainers lazily)
    except (ImportError, RuntimeError) as exc:  # RuntimeError: trl's lazy import failed
        print(f"{TRL_MISSING}\n({exc!r})", file=sys.stderr)
        return 2
    settings = Settings()
    cfg = settings.bootstrap.model_copy(update={"time_budget_s": args.seconds})
    threads = args.threads or cfg.torch_threads

    import random

    import torch

    from simulate.rollouts import SandboxCache
    from trainer.bootstrap.midtrain import midtrained_start
    from trainer.bootstrap.run import run_grpo
    from trainer.init_model import init_model

    workdir = Path(tempfile.mkdtemp(prefix="vs-trl-"))
    model_dir = args.model_dir or init_model(settings.model, workdir / "base")
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    start = midtrained_start(cfg, model_dir, steps=args.midtrain_steps)
    train = start.train
    fixed = random.Random(cfg.seed).sample(train, min(REWARD_TASKS, len(train)))
    print(f"same start: {start.steps} mid-training steps on {len(train)} train tasks; group size "
          f"{cfg.group_size} x {cfg.groups_per_step} tasks per step; {args.seconds:.0f} s "
          f"per side; torch threads {threads}; trl {trl.__version__}", flush=True)
    start_reward, start_held = final_policy(start.policy(lr=cfg.lr), cfg, fixed, start.held_out)

    policy = start.policy(lr=cfg.lr)
    fly = run_grpo(policy, cfg, train, start.held_out, cache=SandboxCache(), progress=False)
    fly_reward, fly_held = final_policy(policy, cfg, fixed, start.held_out)
    fly_ends = curve_ends([h["reward"] for h in fly.history])
    print(f"flywheel ({cfg.mode}, multi-turn, <= {cfg.max_turns} turns): steps {fly.steps:3d}  "
          f"samples/s {fly.samples_per_s:6.2f}  tokens/s {fly.tokens_per_s:7.1f}  "
          f"curve {fly_ends[0]:.3f} -> {fly_ends[1]:.3f}", flush=True)

    policy = start.policy(lr=cfg.lr)
    trl_run = run_trl(policy.model, policy.tokenizer, cfg, train, seconds=args.seconds,
                      threads=threads, workdir=workdir)
    trl_reward, trl_held = final_policy(policy, cfg, fixed, start.held_out)
    trl_ends = curve_ends(trl_run.rewards)
    print(f"trl      (GRPOTrainer, single turn):    steps {trl_run.steps:3d}  "
          f"samples/s {trl_run.samples_per_s:6.2f}  tokens/s {trl_run.tokens_per_s:7.1f}  "
          f"curve {trl_ends[0]:.3f} -> {trl_ends[1]:.3f}")
    plot = plot_curves([(h["wall_s"], h["reward"]) for h in fly.history],
                       list(zip(trl_run.times, trl_run.rewards, strict=True)),
                       workdir / "vs_trl.png")
    print(f"final policies, one measure ({len(fixed)} train tasks x {REWARD_SAMPLES} multi-turn "
          f"episodes; greedy held-out pass@1): start {start_reward:.3f} / {start_held:.1%}, "
          f"flywheel {fly_reward:.3f} / {fly_held:.1%}, trl {trl_reward:.3f} / {trl_held:.1%}; "
          f"curves {plot}")
    print(json.dumps({"bench": "vs_trl", "flywheel_reward": round(fly_reward, 3),
                      "trl_reward": round(trl_reward, 3),
                      "flywheel_tokens_per_s": round(fly.tokens_per_s, 1),
                      "trl_tokens_per_s": round(trl_run.tokens_per_s, 1),
                      "start_reward": round(start_reward, 3),
                      "flywheel_held_out": round(fly_held, 4), "trl_held_out": round(trl_held, 4),
                      "start_held_out": round(start_held, 4),
                      "flywheel_steps": fly.steps, "trl_steps": trl_run.steps,
                      "flywheel_samples_per_s": round(fly.samples_per_s, 2),
                      "trl_samples_per_s": round(trl_run.samples_per_s, 2),
                      "flywheel_curve": [round(x, 3) for x in fly_ends],
                      "trl_curve": [round(x, 3) for x in trl_ends], "seconds": args.seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
