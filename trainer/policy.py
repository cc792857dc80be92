"""The trained policy: the same Hugging Face model class as serving, plus its optimizer.

`Policy.token_logprobs` runs one full-sequence forward over given token ids and returns the
log-probability of every token under the model (temperature applied, as the engine reports it),
which is what GRPO compares to the behavior logprobs recorded at sampling time. Sequences of a
batch are right-padded; padding never reaches a loss because its mask is 0.

    policy = Policy.load(model_dir, lr=1e-3)
    logprobs = policy.token_logprobs(batch.tokens, temperature=1.0)   # (B, T)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class TokenBatch:
    """Right-padded token ids and masks. `loss_mask[b, t]` refers to `tokens[b, t]`."""

    tokens: torch.Tensor  # (B, T) int64
    attention_mask: torch.Tensor  # (B, T) 1 for real tokens
    loss_mask: torch.Tensor  # (B, T) float, 1 where the token is trained

    @classmethod
    def from_sequences(cls, sequences: Sequence[Sequence[int]], masks: Sequence[Sequence[float]],
                       *, pad_id: int, width: int | None = None) -> TokenBatch:
        """`width`: pad to this many tokens (default: the longest sequence)."""
        width = max(len(s) for s in sequences) if width is None else width
        tokens = torch.full((len(sequences), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(sequences), width), dtype=torch.long)
        loss_mask = torch.zeros((len(sequences), width), dtype=torch.float32)
        for row, (seq, mask) in enumerate(zip(sequences, masks, strict=True)):
            tokens[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
            attention[row, :len(seq)] = 1
            loss_mask[row, :len(mask)] = torch.tensor(mask, dtype=torch.float32)
        return cls(tokens, attention, loss_mask)

    def to(self, device: torch.device) -> TokenBatch:
        return TokenBatch(self.tokens.to(device), self.attention_mask.to(device),
                          self.loss_mask.to(device))

    def pad_like(self, rows: Sequence[Sequence[float]]) -> torch.Tensor:
        """Right-pad per-token float rows (e.g. behavior logprobs) to (B, T)."""
        out = torch.zeros(self.tokens.shape, dtype=torch.float32)
        for row, values in enumerate(rows):
            out[row, :len(values)] = torch.tensor(values, dtype=torch.float32)
        return out


def sequence_logprobs(model: Any, batch: TokenBatch, *,
                      temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """log p(tokens[:, t] | tokens[:, :t]) for t >= 1; position 0 gets 0. Returns (B, T).

    `temperature`: one for the batch or one per row, (B,); 0 means greedy (raw logits)."""
    logits = model(input_ids=batch.tokens, attention_mask=batch.attention_mask,
                   use_cache=False).logits[:, :-1].float()  # (B, T-1, V)
    if isinstance(temperature, torch.Tensor):
        temps = torch.where(temperature > 0, temperature, 1.0).to(logits.dtype)  # (B,)
        logits = logits / temps[:, None, None]
    elif temperature > 0:
        logits = logits / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    picked = logprobs.gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)  # (B, T-1)
    return torch.nn.functional.pad(picked, (1, 0))


class Policy:
    """A causal LM being trained: logprobs, optimizer step, weights out for the rollout side."""

    def __init__(self, model: Any, tokenizer: Any, *, lr: float, weight_decay: float = 0.0,
                 max_grad_norm: float = 1.0) -> None:
        self.model = model.train()
        self.tokenizer = tokenizer
        self.max_grad_norm = max_grad_norm
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99),
                                           weight_decay=weight_decay)
        self.version = 0

    @classmethod
    def load(cls, model_dir: Path, *, lr: float, **kwargs: Any) -> Policy:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return cls(model, tokenizer, lr=lr, **kwargs)

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    def batch(self, sequences: Sequence[Sequence[int]],
              masks: Sequence[Sequence[float]]) -> TokenBatch:
        return TokenBatch.from_sequences(sequences, masks, pad_id=self.pad_id)

    def token_logprobs(self, batch: TokenBatch, *, temperature: float = 1.0) -> torch.Tensor:
        return sequence_logprobs(self.model, batch, temperature=temperature)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def optimizer_step(self) -> float:
        """Clip, step, zero grads, bump the version; returns the pre-clip grad norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return float(norm)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A detached copy of the weights, safe to hand to another thread."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def save(self, out_dir: Path) -> Path:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out_dir)
        self.tokenizer.save_pretrained(out_dir)
        return out_dir
