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
