"""Feedback -> scalar reward, through the configurable `RewardMap` (ingest/config.py)."""

from __future__ import annotations

from ingest.config import RewardMap
from ingest.events import FeedbackReceived


def reward_for(feedback: FeedbackReceived, rewards: RewardMap) -> float:
    """The reward one feedback event pays; `edit_kept` scales the kept fraction."""
    if feedback.kind == "edit_kept":
        assert feedback.value is not None  # FeedbackReceived guarantees it for edit_kept
        return rewards.edit_kept_offset + rewards.edit_kept_scale * feedback.value
    return float(getattr(rewards, feedback.kind))


def turn_rewards(reward: float, turns: int, discount: float) -> list[float]:
    """The reward of each turn k = 0..T-1 of a session judged `reward` as a whole:
    `reward * discount ** (T - 1 - k)`, so the last turn (the outcome's nearest) gets it all
    and, with discount 1, every turn shares it (as the bootstrap's multi-turn episodes do)."""
    return [reward * discount ** (turns - 1 - k) for k in range(turns)]
