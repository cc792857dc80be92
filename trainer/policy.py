"""The trained policy: the same Hugging Face model class as serving, plus its optimizer.

`sequence_logprobs` runs a forward over given token ids (a prefix every row shares, once) and
returns the log-probability of every trained token under the model (temperature applied, as
the engine reports it), which is what GRPO compares to the behavior logprobs recorded at
sampling time.
Sequences of a batch are right-padded; padding never reaches a loss because its mask is 0.

`Policy.train_step` is one optimizer step of an `Objective` (mid-training's next-token loss,
the bootstrap's GRPO loss) on `Rows`. Over N ranks (trainer/distributed.py) the model is
sharded with FSDP2 and the leader's collective phases (`train_step`, `state_dict`,
`unsharded_model`, `save`) run on every rank, each rank training rows r, r+N, … with its loss
weighted so that the ranks' mean gradient is the whole batch's.

    policy = Policy.load(model_dir, lr=1e-3)
    metrics = policy.train_step(Rows(sequences, masks), NextTokenLoss(), 1e-3)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from kernels.moe_replay import maybe_replay_routes, stack_logged_routes
from kernels.weights import checkpoint_dtype, served_dtype
from trainer.distributed import (
    Phases,
    World,
    collective,
    full_state_dict,
    grad_norm,
    shard,
)
from trainer.precision import ServedCopy


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
                      temperature: float | torch.Tensor = 1.0,
                      share_prefix: bool = True,
                      routes: torch.Tensor | None = None) -> torch.Tensor:
    """log p(tokens[:, t] | tokens[:, :t]) at every position t that some row of the batch
    trains (`loss_mask`); 0 elsewhere, position 0 included. Returns (B, T).
    `next_token_logprobs` has how, and the arguments."""
    logprobs, keep = next_token_logprobs(model, batch, temperature=temperature,
                                         share_prefix=share_prefix, routes=routes)
    picked = logprobs.gather(-1, batch.tokens[:, keep + 1, None]).squeeze(-1)  # (B, K)
    out = torch.zeros(batch.tokens.shape, dtype=picked.dtype, device=picked.device)
    return out.index_copy(1, keep + 1, picked)


def next_token_logprobs(model: Any, batch: TokenBatch, *,
                        temperature: float | torch.Tensor = 1.0,
                        share_prefix: bool = True,
                        routes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole next-token distribution, log-softmaxed, at every position whose next token
    some row of the batch trains: ((B, K, V) float32 logprobs, (K,) positions `keep`), row b's
    distribution at `keep[k]` being that of `tokens[b, keep[k] + 1]`.

    The model's head and softmax run at those positions only (`logits_to_keep`): most of a row
    is prompt, tool output or padding, and the head over a vocabulary is the largest matmul of a
    small model. A prefix every row shares (the system prompt and tool listing) goes through
    the layers once and reaches the rows as a key/value cache that the backward pass flows
    through, so its gradient is the same as if each row had computed it (`share_prefix=False`:
    one forward over whole rows). An FSDP2-sharded model always runs one forward: its blocks
    free their gathered weights after each forward and expect one backward per forward.
    `temperature`: one for the batch or one per row, (B,); 0 means greedy (raw logits).
    `routes`: (B, T, layers, k) MoE experts to replay (`kernels.moe_replay`), on the batch's
    device; the shared prefix is then only as long as the rows' routes agree too."""
    keep = batch.loss_mask[:, 1:].any(0).nonzero().squeeze(-1)  # predicting a trained token
    if keep.numel() == 0:  # nothing trained (a rank's silenced row): one position keeps the graph
        keep = torch.zeros(1, dtype=torch.long, device=batch.tokens.device)
    prefix = shared_prefix(batch, limit=int(keep.min()), routes=routes) \
        if share_prefix and not _fsdp_sharded(model) else 0
    with maybe_replay_routes(model, routes) as replayer:
        cache = None
        if prefix:
            from transformers import DynamicCache

            cache = DynamicCache(config=model.config)
            replayer.routes = None if routes is None else routes[:1, :prefix]
            model(input_ids=batch.tokens[:1, :prefix], past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
            cache.batch_repeat_interleave(batch.tokens.shape[0])
        replayer.routes = None if routes is None else routes[:, prefix:]
        logits = model(input_ids=batch.tokens[:, prefix:], attention_mask=batch.attention_mask,
                       past_key_values=cache, use_cache=cache is not None,
                       logits_to_keep=keep - prefix).logits.float()  # (B, K, V)
    if isinstance(temperature, torch.Tensor):
        temps = torch.where(temperature > 0, temperature, 1.0).to(logits.dtype)  # (B,)
        logits = logits / temps[:, None, None]
    elif temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1), keep


def _fsdp_sharded(model: Any) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)  # trainer/distributed.py shards the root too


MIN_SHARED_PREFIX = 32  # tokens: below this a second forward costs more than it saves


def shared_prefix(batch: TokenBatch, *, limit: int, routes: torch.Tensor | None = None) -> int:
    """How many leading tokens every row of `batch` has in common (at most `limit`, the first
    position whose logits are needed), with the same replayed experts where `routes` are
    given; 0 when that is under `MIN_SHARED_PREFIX` or there is one row."""
    tokens = batch.tokens
    if tokens.shape[0] < 2:
        return 0
    same = (tokens == tokens[:1]) & (batch.attention_mask == 1)  # (B, T)
    if routes is not None:
        same &= (routes == routes[:1]).flatten(2).all(-1)
    same = same.all(0)  # (T,)
    length = min(int(same.long().cumprod(0).sum()), limit)
    return length if length >= MIN_SHARED_PREFIX else 0


@dataclass(frozen=True)
class Rows:
    """One batch as plain lists (the leader sends it to the other ranks). Per row: token ids,
    loss mask, and, for a policy-gradient objective, behavior logprobs per token and an
    advantage; `routes`, where given, the MoE experts the engine chose for the row's tokens
    ((tokens, layers, k) int16, `kernels.moe_replay.NO_ROUTE` where it has none; None for a
    row without), which the forward replays."""

    sequences: list[list[int]]
    masks: list[Sequence[float]]
    behavior: list[list[float]] | None = None
    advantages: list[float] | None = None
    routes: list[np.ndarray | None] | None = None

    def __len__(self) -> int:
        return len(self.sequences)

    def take(self, start: int, step: int) -> Rows:
        """Rows start, start+step, … (a rank's share)."""
        return Rows(self.sequences[start::step], self.masks[start::step],
                    None if self.behavior is None else self.behavior[start::step],
                    None if self.advantages is None else self.advantages[start::step],
                    None if self.routes is None else self.routes[start::step])

    def replay_tensor(self, width: int) -> torch.Tensor | None:
        return None if self.routes is None else stack_logged_routes(self.routes, width)

    def silenced(self) -> Rows:
        """The first row with nothing in its loss: what a rank without a row trains, so that
        every rank runs the same collectives."""
        first = self.take(0, len(self) or 1)
        return dataclasses.replace(first, masks=[[0.0] * len(first.masks[0])])


class Objective(Protocol):
    """A loss over a batch's logprobs; `aggregation` says what its mean is over ("token":
    every trained token of the batch, "sequence": every row with one)."""

    temperature: float
    aggregation: str

    def loss(self, logp: torch.Tensor, batch: TokenBatch, behavior: torch.Tensor | None,
             advantages: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]: ...


@dataclass(frozen=True)
class NextTokenLoss:
    """Mid-training: the token mean of -log p over the masked tokens."""

    temperature: float = 1.0
    aggregation: str = "token"

    def loss(self, logp: torch.Tensor, batch: TokenBatch, behavior: torch.Tensor | None,
             advantages: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch.loss_mask  # (B, T)
        return -(logp * mask).sum() / mask.sum().clamp(min=1.0), {}


def _weight(masks: Sequence[Sequence[float]], aggregation: str) -> float:
    """What a batch's mean is over: its trained tokens, or its rows with a trained token."""
    if aggregation == "token":
        return float(sum(sum(m) for m in masks))
    return float(sum(1 for m in masks if any(m)))


class Policy:
    """A causal LM being trained: logprobs, optimizer step, weights out for the rollout side."""

    def __init__(self, model: Any, tokenizer: Any, *, lr: float, weight_decay: float = 0.0,
                 max_grad_norm: float = 1.0, adam_eps: float = 1e-8,
                 world: World | None = None, served: Any | None = None) -> None:
        self.world = world or World()
        self.phases = Phases(self.world)
        self.model = model.train()  # float32 master weights: what the optimizer steps
        # the weights in the served dtype (`model` itself in float32): forward, backward and
        # every policy version published (trainer/precision.py)
        self.served = ServedCopy(self.model, (served if served is not None else model).train())
        self.tokenizer = tokenizer
        self.max_grad_norm = max_grad_norm
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99),
                                           eps=adam_eps, weight_decay=weight_decay)
        self.version = 0

    @classmethod
    def load(cls, model_dir: Path, *, lr: float, world: World | None = None,
             batch_invariant: bool = False, **kwargs: Any) -> Policy:
        """The model of `model_dir` on `world`'s device, sharded over its ranks;
        `batch_invariant`: the kernels of kernels/batch_invariant.py."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        world = world or World()
        hf_logging.disable_progress_bar()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if not world.sharded:  # sharded, each block moves its own shard to the device
            model = model.to(world.device)  # type: ignore[arg-type]  # transformers' stub
        if batch_invariant:
            from kernels.batch_invariant import enable_batch_invariant

            enable_batch_invariant(model)
        served = ServedCopy.of(model, checkpoint_dtype(model_dir))
        return cls(shard(model, world), tokenizer, lr=lr, world=world,
                   served=shard(served.model, world) if served.separate else None, **kwargs)

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    def batch(self, sequences: Sequence[Sequence[int]],
              masks: Sequence[Sequence[float]]) -> TokenBatch:
        return TokenBatch.from_sequences(sequences, masks, pad_id=self.pad_id)

    def token_logprobs(self, batch: TokenBatch, *, temperature: float = 1.0) -> torch.Tensor:
        return sequence_logprobs(self.served.model, batch, temperature=temperature)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """The master weights become `weights` (upcast where they are the served dtype's), and
        the served copy follows. One process only."""
        self.model.load_state_dict(weights)
        self.served.refresh()

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def optimizer_step(self) -> float:
        """Clip, step, zero grads, bump the version; returns the pre-clip grad norm."""
        self.served.gradients_to_master()
        norm = grad_norm(self.model, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.served.refresh()
        self.version += 1
        return norm

    # -- the leader's phases, mirrored on every rank ------------------------------------------
    def follow(self) -> None:
        """A rank other than the leader: run the phases the leader enters, until `finish`."""
        self.phases.follow(self)

    def finish(self) -> None:
        self.phases.finish()

    @collective
    def train_step(self, rows: Rows, objective: Objective, lr: float) -> dict[str, float]:
        """One optimizer step of `objective` on `rows` at rate `lr`: metrics (the objective's,
        over the whole batch), its loss and the pre-clip grad norm."""
        self.set_lr(lr)
        world = self.world
        mine = rows.take(world.rank, world.size)
        mine = mine if len(mine) else rows.silenced()
        batch = TokenBatch.from_sequences(mine.sequences, mine.masks, pad_id=self.pad_id,
                                          width=max(len(s) for s in rows.sequences))
        behavior = None if mine.behavior is None else batch.pad_like(mine.behavior)  # (B, T)
        advantages = (None if mine.advantages is None
                      else torch.tensor(mine.advantages, dtype=torch.float32))  # (B,)
        batch = batch.to(world.device)
        routes = mine.replay_tensor(batch.tokens.shape[1])
        logp = sequence_logprobs(self.served.model, batch, temperature=objective.temperature,
                                 routes=None if routes is None else routes.to(world.device))
        loss, metrics = objective.loss(
            logp, batch, None if behavior is None else behavior.to(world.device),
            None if advantages is None else advantages.to(world.device))
        mine_w = _weight(mine.masks, objective.aggregation)
        total_w = _weight(rows.masks, objective.aggregation)
        # the batch's mean, after FSDP averages the ranks' gradients (x 1.0 in one process)
        (loss * world.loss_share(mine_w, total_w)).backward()
        metrics = world.batch_means({**metrics, "loss": float(loss.detach())}, mine_w)
        return metrics | {"grad_norm": self.optimizer_step()}

    @collective
    def written_probability(self, rows: Rows, temperature: float) -> list[float]:
        """Per row, the probability that the model, sampling at `temperature`, writes the row's
        masked tokens given what precedes each: the exp of their summed logprobs."""
        world = self.world
        mine = rows.take(world.rank, world.size)
        ran = mine if len(mine) else rows.silenced()  # every rank runs the forward
        batch = TokenBatch.from_sequences(ran.sequences, ran.masks,
                                          pad_id=self.pad_id).to(world.device)
        with torch.no_grad():
            logp = sequence_logprobs(self.served.model, batch, temperature=temperature)
        out = torch.zeros(len(rows), dtype=torch.float64)
        if len(mine):
            out[world.rank::world.size] = (logp * batch.loss_mask).sum(1).double().exp().cpu()
        return world.all_sum(out).tolist()

    @collective
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole weights in the served dtype, detached copies safe to hand to another
        thread ({} on the ranks other than the leader)."""
        return full_state_dict(self.served.model, self.world)

    @collective
    def unsharded_model(self) -> Any:
        """A plain copy of the model holding the current weights in the served dtype, for an
        engine (None on the ranks other than the leader)."""
        if not self.world.sharded:
            return copy.deepcopy(self.served.model)
        weights = full_state_dict(self.served.model, self.world)
        if not self.world.leader:
            return None
        from transformers import AutoModelForCausalLM

        from kernels.batch_invariant import enable_batch_invariant, is_batch_invariant

        config = self.served.model.config  # the served dtype's (trainer/precision.py)
        model = AutoModelForCausalLM.from_config(config, dtype=served_dtype(config))
        model.load_state_dict(weights)
        if is_batch_invariant(self.model):
            enable_batch_invariant(model)
        return model.train()

    @collective
    def save(self, out_dir: Path) -> Path:
        """The weights (in the served dtype) and the tokenizer as a Hugging Face model
        directory (the leader's)."""
        model = self.served.model if not self.world.sharded else self.unsharded_model()
        if self.world.leader:
            out_dir.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(out_dir)
            self.tokenizer.save_pretrained(out_dir)
        return out_dir
