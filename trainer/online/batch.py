"""The online trainer's batch: experiences laid out as rows, a session's turns packed in one.

An agent session is several generations, and turn k's prompt is turn k-1's prompt, its
completion, the tool's reply and a new assistant header: the same tokens again. Trained one
experience per row, a 3-turn session costs its first prompt three times; packed, a row is the
last turn's prompt and completion, with every turn's completion tokens trained (loss mask 1,
each with its own advantage and behavior logprobs) and the rest context. The forward is then
the episode's, as in the bootstrap's GRPO, about half the tokens.

A turn joins the row of the turn before it only when its prompt starts with that row's tokens
exactly (the server's chat template re-tokenizes the conversation, which reproduces the
sampled ids unless the model sampled a non-canonical tokenization) and both were sampled at one
temperature; otherwise it starts a row of its own. The row's MoE routes are its last turn's:
the engine routed that turn's whole prompt and completion, earlier turns' tokens included.

    rows = pack_rows(experiences, advantages)      # advantages (N,), one per experience
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ingest.events import ExperienceReady, PackedArray


@dataclass
class Row:
    """One training row: token ids and, per token, loss mask, behavior logprob, advantage."""

    tokens: list[int]
    mask: list[float]
    behavior: list[float]
    advantage: list[float]
    temperature: float
    routes: PackedArray | None  # (len(tokens) - 1, layers, k) as served, or None
    experiences: list[ExperienceReady] = field(default_factory=list)

    @classmethod
    def of(cls, experience: ExperienceReady, advantage: float) -> Row:
        prompt = experience.prompt_token_ids.tolist()
        completion = experience.completion_token_ids.tolist()
        return cls(prompt + completion, [0.0] * len(prompt) + [1.0] * len(completion),
                   [0.0] * len(prompt) + experience.logprobs.tolist(),
                   [0.0] * len(prompt) + [advantage] * len(completion),
                   experience.sampling.temperature, experience.routed_experts, [experience])

    def extend(self, experience: ExperienceReady, advantage: float) -> bool:
        """Append `experience` as this row's next turn; False (nothing changed) when its
        prompt does not continue this row or its temperature differs."""
        prompt = experience.prompt_token_ids.tolist()
        if experience.sampling.temperature != self.temperature \
                or prompt[:len(self.tokens)] != self.tokens:
            return False
        new = len(prompt) - len(self.tokens)
        completion = experience.completion_token_ids.tolist()
        self.tokens = prompt + completion
        self.mask += [0.0] * new + [1.0] * len(completion)
        self.behavior += [0.0] * new + experience.logprobs.tolist()
        self.advantage += [0.0] * new + [advantage] * len(completion)
        self.routes = experience.routed_experts
        self.experiences.append(experience)
        return True


def pack_rows(experiences: Sequence[ExperienceReady], advantages: Sequence[float]
              ) -> list[Row]:
    """One row per experience, except that the turns of one session (in turn order) share a
    row while each continues the one before."""
    rows: list[Row] = []
    open_rows: dict[str, Row] = {}  # session_id -> the row its next turn may continue
    order = sorted(range(len(experiences)), key=lambda i: _turn_order(experiences[i], i))
    for i in order:
        experience, advantage = experiences[i], float(advantages[i])
        session = experience.session_id if experience.turn is not None else None
        row = open_rows.get(session) if session is not None else None
        if row is None or not row.extend(experience, advantage):
            row = Row.of(experience, advantage)
            rows.append(row)
        if session is not None:
            open_rows[session] = row
    return rows


def _turn_order(experience: ExperienceReady, index: int) -> tuple[str, int, int]:
    """Turns of a session together and in order; everything else keeps its place."""
    if experience.turn is None or experience.session_id is None:
        return ("", index, 0)
    return (experience.session_id, experience.turn, index)
