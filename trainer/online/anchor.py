"""The format anchor: the online trainer holds what the served release is sure of.

Live traffic shows the trainer one or two decisions a session (the value the agent writes);
every other token of a call (the tool's name, the tags, the file's path) is written at
probability 0.999 or more and carries no signal, yet Adam moves every weight by about the rate
whatever its signal. In some demo runs 24 steps broke the call syntax itself on tasks the
traffic did not show (`<function=apply_testsolution.py…`, docs/demo.md): a candidate the gate
then refuses, a release's time lost.

So each step adds `coef` x the KL from the served release (the trainer's KL reference) to the
policy, over the whole next-token distribution, on `rows` demonstration episodes
(`simulate/demonstrations.py`) of the anchor's task source's train split, at the assistant
positions where the served release is sure (its top token's probability at least
`confidence`). It pulls toward the served release, not toward the demonstrations: it teaches
nothing by itself (with every advantage 0 the policy stays where it is, its gradient being 0
there), and where the served release is unsure, the decisions the feedback is about, it does
not hold at all.

    python -m pytest tests/trainer/online/test_anchor.py
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import torch

from trainer.online.config import FormatAnchorSettings
from trainer.policy import TokenBatch, next_token_logprobs

MAX_EPISODES = 256  # demonstration episodes the anchor draws its rows from


def anchor_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
              confidence: float) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(ref || policy) per position, averaged over the positions of `mask` where the
    reference's top token has probability >= `confidence`.

    logp (B, K, V) the policy's next-token logprobs (with grad); ref_logp (B, K, V) the
    reference's; mask (B, K) bool. Returns (the mean KL (), the held positions (B, K) bool);
    the mean is 0 where no position is held."""
    ref_logp = ref_logp.detach()
    held = mask & (ref_logp.max(-1).values >= math.log(confidence))  # (B, K)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)  # (B, K)
    return (kl * held).sum() / held.sum().clamp(min=1), held


@dataclass(frozen=True)
class FormatAnchor:
    """The anchor's demonstration episodes and settings; `loss` is one step's term."""

    episodes: list[tuple[list[int], list[int]]]  # (token ids, mask on the assistant turns)
    cfg: FormatAnchorSettings
    pad_id: int

    @classmethod
    def build(cls, cfg: FormatAnchorSettings, tokenizer: Any, pad_id: int) -> FormatAnchor:
        """Episodes of up to `MAX_EPISODES` train tasks (a seeded draw), through the
        tokenizer's chat template."""
        from simulate.demonstrations import transcript
        from simulate.harness import ChatTokens
        from simulate.tasks import build_task_source

        tasks = [t for t in build_task_source(cfg.tasks).split("train") if t.demonstrable]
        if not tasks:
            raise ValueError("online.anchor: the task source's train split has no task with a "
                             "solution to demonstrate")
        tasks = random.Random(cfg.seed).sample(tasks, min(MAX_EPISODES, len(tasks)))
        chat = ChatTokens(tokenizer)
        return cls([transcript(chat, t) for t in tasks], cfg, pad_id)

    def batch(self, step: int) -> TokenBatch:
        """The episodes of trainer step `step`: a draw seeded by the step, so a resumed trainer
        and every rank draw the same."""
        rng = random.Random(f"{self.cfg.seed}:{step}")
        picked = rng.sample(self.episodes, min(self.cfg.rows, len(self.episodes)))
        return TokenBatch.from_sequences([ids for ids, _ in picked],
                                         [mask for _, mask in picked], pad_id=self.pad_id)

    def loss(self, model: Any, reference: Any, step: int, device: torch.device
             ) -> tuple[torch.Tensor, dict[str, float]]:
        """coef x the anchor's KL at `step` (with grad through `model`) and its metrics:
        `anchor_kl`, `anchor_held` (the share of assistant positions held)."""
        batch = self.batch(step).to(device)
        with torch.no_grad():
            ref, keep = next_token_logprobs(reference, batch)
        logp, _ = next_token_logprobs(model, batch)
        mask = batch.loss_mask[:, keep + 1].bool()  # (B, K)
        kl, held = anchor_kl(logp, ref, mask, self.cfg.confidence)
        share = float(held.sum()) / max(1, int(mask.sum()))
        return self.cfg.coef * kl, {"anchor_kl": float(kl.detach()), "anchor_held": share}
