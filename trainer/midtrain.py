"""Mid-training: next-token prediction on transcripts of the train tasks, as the harness shows them.

Each train task becomes the episode a good agent would have: system prompt, the task, a
`write_file` of the canonical solution, `run_tests` and its real observation, `finish`. The
loss covers the assistant turns only (the tokens the policy will later be asked to produce), so
the tiny model learns the tool format and some solutions; RL then has to get the held-out
parameter values right.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

from simulate.harness import ChatTokens
from simulate.rollouts import SYSTEM_PROMPT
from simulate.tasks import Task
from trainer.policy import Policy


def solution_text(task: Task) -> str:
    """The file an agent writes: the signature line and the canonical body."""
    signature = task.prompt.splitlines()[0]
    return f"{signature}\n{task.canonical_solution or ''}"


def transcript(chat: ChatTokens, task: Task) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of the demonstration episode for `task`."""
    ids = chat.prompt(SYSTEM_PROMPT, task.prompt)
    mask = [0] * len(ids)
    turns = [f"<tool>write_file solution.py\n{solution_text(task)}</tool>",
             "<tool>run_tests</tool>", "<tool>finish</tool>"]
    tests = len(re.findall(r"^def test_", task.tests, flags=re.M))
    observations = ["wrote solution.py", f"passed: {tests}/{tests} tests passed"]
    for i, turn in enumerate(turns):
        reply = chat.encode(turn) + [chat.im_end]
        ids += reply + chat.newline
        mask += [1] * len(reply) + [0] * len(chat.newline)
        if i < len(observations):
            obs = chat.turn("tool", observations[i]) + chat.open("assistant")
            ids += obs
            mask += [0] * len(obs)
    return ids, mask


@dataclass
class MidTrainResult:
    steps: int
    final_loss: float


def midtrain(policy: Policy, chat: ChatTokens, tasks: list[Task], *, steps: int, batch_size: int,
             lr: float, seed: int = 0) -> MidTrainResult:
    """`steps` AdamW steps of masked next-token loss over shuffled demonstration transcripts."""
    corpus = [transcript(chat, t) for t in tasks if t.canonical_solution]
    rng = random.Random(seed)
    policy.set_lr(lr)
    loss_value = float("nan")
    for step in range(steps):
        rows = [corpus[rng.randrange(len(corpus))] for _ in range(batch_size)]
        batch = policy.batch([r[0] for r in rows], [r[1] for r in rows])
        logp = policy.token_logprobs(batch)  # (B, T)
        loss = -(logp * batch.loss_mask).sum() / batch.loss_mask.sum()
        loss.backward()
        # cosine decay keeps the last steps from undoing the early ones
        policy.set_lr(lr * 0.5 * (1 + torch.cos(torch.tensor(step / steps * 3.14159)).item()))
        policy.optimizer_step()
        loss_value = float(loss.detach())
    policy.version = 0  # mid-training produces the start policy: version 0 of the RL run
    return MidTrainResult(steps=steps, final_loss=loss_value)
