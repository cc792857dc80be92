"""Baselines of the online objective: what reward a row is compared with (A_i = r_i - b_i).

`batch_mean` is the leave-one-out mean of the batch; `bucket_mean` a running mean per context
bucket, the bucket a hash of the conversation's opening (the system and user messages before
the first assistant turn), so every turn of an agent's sessions on one task meets that task's
mean. Its state is checkpointed with the trainer (trainer/online/config.py has the knobs).
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from ingest.events import ExperienceReady
from trainer.online.config import BaselineSettings, BatchMeanBaseline
from trainer.online.loss import leave_one_out_baseline, running_mean_update


class Baseline(abc.ABC):
    """b_i for each row of a batch; `update` folds the batch in after the step."""

    @abc.abstractmethod
    def values(self, keys: Sequence[str], rewards: torch.Tensor) -> torch.Tensor: ...

    def update(self, keys: Sequence[str], rewards: torch.Tensor) -> None:  # noqa: B027
        """Stateless baselines (the batch mean) keep nothing across batches."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027
        """Nothing to restore for a stateless baseline."""


class BatchMean(Baseline):
    def values(self, keys: Sequence[str], rewards: torch.Tensor) -> torch.Tensor:
        return leave_one_out_baseline(rewards)


class BucketMean(Baseline):
    """Running mean reward per context bucket; unseen buckets use the global running mean."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.buckets: dict[str, list[float]] = {}  # key -> [mean, count]
        self.overall = [0.0, 0.0]

    def values(self, keys: Sequence[str], rewards: torch.Tensor) -> torch.Tensor:
        return torch.tensor([self.buckets.get(k, self.overall)[0] for k in keys],
                            dtype=rewards.dtype)

    def update(self, keys: Sequence[str], rewards: torch.Tensor) -> None:
        for key, reward in zip(keys, rewards.tolist(), strict=True):
            mean, count = self.buckets.get(key, [0.0, 0.0])
            self.buckets[key] = list(running_mean_update(mean, int(count), reward, self.decay))
            self.overall = list(running_mean_update(self.overall[0], int(self.overall[1]),
                                                    reward, self.decay))

    def state_dict(self) -> dict[str, Any]:
        return {"buckets": self.buckets, "overall": self.overall}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buckets = {k: list(v) for k, v in state.get("buckets", {}).items()}
        self.overall = list(state.get("overall", [0.0, 0.0]))


def build_baseline(settings: BaselineSettings) -> Baseline:
    if isinstance(settings, BatchMeanBaseline):
        return BatchMean()
    return BucketMean(settings.decay)


def conversation_opening(prompt: Sequence[int], assistant_header: Sequence[int]) -> list[int]:
    """The prompt up to its first assistant turn (the whole prompt if it has none): the system
    and user messages a conversation opened with. Every turn of an agent's session on one
    task shares it, so its bucket's running mean is that task's baseline."""
    ids, header = list(prompt), list(assistant_header)
    for start in range(len(ids) - len(header) + 1):
        if ids[start:start + len(header)] == header:
            return ids[:start]
    return ids


def bucket_key(experience: ExperienceReady, buckets: int,
               assistant_header: Sequence[int] = ()) -> str:
    """The context bucket of an experience: a hash of its conversation's opening."""
    prompt = experience.prompt_token_ids.unpack()
    opening = conversation_opening(prompt.tolist(), assistant_header) if assistant_header \
        else prompt.tolist()
    digest = hashlib.sha256(str(opening).encode()).digest()
    return str(int.from_bytes(digest[:8], "little") % buckets)
