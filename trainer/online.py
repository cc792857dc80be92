"""The online trainer: joined live feedback in (`experiences`), a better policy out.

Each step takes a batch of `ExperienceReady` records (at least `online.min_batch`), recomputes
the logprobs of the served tokens with the logged MoE routes replayed, and applies the online
objective of `trainer/online_loss.py` (baseline advantage, PPO's clip anchored at the behavior
logprobs, k3 KL anchor to the served release), with gradient clipping.

Crash safety (trainer/checkpoint.py): the consumer is assigned all partitions by hand and seeks
to the offsets stored in the latest checkpoint; a step's weights, optimizer, offsets and ledger
are checkpointed together; Kafka offsets are committed only after that checkpoint is durable;
records whose experience ids are in the ledger are skipped (a session verdict yields
several experiences under one feedback event id). The loop around
the trainer (consumer, batching, control, releases) is trainer/online_loop.py.

    flywheel train-online --data-dir data
"""

from __future__ import annotations

import abc
import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from ingest.events import ExperienceReady
from kernels.weights import state_dict_sha256
from trainer.checkpoint import CheckpointStore, Ledger, LedgerEntry
from trainer.online_batch import Row, pack_rows
from trainer.online_config import BaselineSettings, BatchMeanBaseline, OnlineTrainerSettings
from trainer.online_loss import (
    advantages,
    clipped_online_loss,
    leave_one_out_baseline,
    online_loss,
    running_mean_update,
)
from trainer.policy import TokenBatch, sequence_logprobs

log = logging.getLogger(__name__)
Offsets = dict[str, int]  # "topic:partition" -> next offset to read


# ---- baselines ---------------------------------------------------------------------------
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


# ---- the trainer -------------------------------------------------------------------------
@dataclass
class TrainerState:
    """Everything besides weights and optimizer that a resume needs (JSON in the checkpoint)."""

    step: int = 0
    sequence: int = 0  # checkpoint number
    offsets: Offsets = field(default_factory=dict)
    baseline: dict[str, Any] = field(default_factory=dict)
    reference_sha256: str | None = None
    release_from_step: int = 0  # first step not contained in a release yet
    last_release: dict[str, Any] | None = None
    last_release_wall: float = field(default_factory=time.time)


@dataclass
class ReleaseOutcome:
    version: int
    published: bool
    sha256: str
    reason: str = ""


class ReleaseSink(Protocol):
    """The release pipeline of trainer/release.py, as the trainer sees it."""

    def release(self, candidate: Path, provenance: dict[str, Any], *,
                requested_by: str, reason: str) -> ReleaseOutcome: ...


def configure_torch(cfg: OnlineTrainerSettings) -> None:
    torch.manual_seed(cfg.seed)
    if cfg.deterministic:
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
    elif cfg.threads:
        torch.set_num_threads(cfg.threads)


class OnlineTrainer:
    """One policy, its optimizer, the KL reference, the baseline, the ledger; named phases."""

    def __init__(self, cfg: OnlineTrainerSettings, model: Any, reference: Any, pad_id: int,
                 store: CheckpointStore, *, assistant_header: Sequence[int] = ()) -> None:
        self.cfg = cfg
        self.assistant_header = list(assistant_header)  # where a conversation's opening ends
        self.model = model.train()
        self.reference = reference.eval().requires_grad_(False)
        self.pad_id = pad_id
        self.store = store
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99),
                                           weight_decay=cfg.weight_decay)
        self.baseline = build_baseline(cfg.baseline)
        self.state = TrainerState()
        self.ledger = Ledger()
        self.last_metrics: dict[str, float] = {}

    @classmethod
    def restore(cls, cfg: OnlineTrainerSettings, model_dir: Path, root: Path, *,
                batch_invariant: bool = False) -> OnlineTrainer:
        """Build from the base model, then load the latest checkpoint under `root` if any;
        `batch_invariant`: the same kernels as a serving engine in that mode."""
        import copy

        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from simulate.harness import ChatTokens

        hf_logging.disable_progress_bar()
        configure_torch(cfg)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        header = ChatTokens(AutoTokenizer.from_pretrained(model_dir)).open("assistant")
        if batch_invariant:
            from kernels.batch_invariant import enable_batch_invariant

            enable_batch_invariant(model)
        reference = copy.deepcopy(model)
        pad_id = int(model.config.pad_token_id)
        store = CheckpointStore(root, keep=cfg.keep_checkpoints)
        trainer = cls(cfg, model, reference, pad_id, store, assistant_header=header)
        trainer.load_latest()
        return trainer

    def load_latest(self) -> bool:
        ckpt = self.store.load()
        if ckpt is None:
            self.state.reference_sha256 = state_dict_sha256(self.reference.state_dict())
            return False
        self.model.load_state_dict(ckpt.weights)
        self.optimizer.load_state_dict(ckpt.optimizer)
        self.state = TrainerState(**ckpt.state)
        self.baseline.load_state_dict(self.state.baseline)
        self.ledger = ckpt.ledger
        if self.state.reference_sha256 != state_dict_sha256(self.reference.state_dict()):
            self.reference.load_state_dict(self.store.load_reference(
                self.state.reference_sha256 or ""))
        log.info("resumed %s at step %d", ckpt.name, self.state.step)
        return True

    # -- phases ------------------------------------------------------------------------------
    def logprobs(self, model: Any, batch: TokenBatch, rows: Sequence[Row]) -> torch.Tensor:
        """(B, T) logprobs of every token, per-row temperature, logged routes replayed."""
        temps = [r.temperature for r in rows]
        routes = self._routes(rows, batch.tokens.shape[1])
        out = torch.zeros(batch.tokens.shape, dtype=torch.float32)
        for temp in sorted(set(temps)):
            picked = [i for i, t in enumerate(temps) if t == temp]
            sub = batch if len(picked) == len(temps) else TokenBatch(
                batch.tokens[picked], batch.attention_mask[picked], batch.loss_mask[picked])
            with _maybe_replay(model, None if routes is None else routes[picked]):
                out[picked] = sequence_logprobs(model, sub, temperature=temp)
        return out

    def _routes(self, rows: Sequence[Row], length: int) -> torch.Tensor | None:
        if not self.cfg.router_replay or any(r.routes is None for r in rows):
            return None
        from kernels.moe_replay import stack_routes

        seqs = [torch.from_numpy(r.routes.unpack().copy())  # type: ignore[union-attr]
                for r in rows]
        return stack_routes(seqs, length)  # (B, T, L, K); last token and padding: NO_ROUTE

    def forward_backward(self, experiences: Sequence[ExperienceReady]) -> dict[str, float]:
        rewards = torch.tensor([e.reward for e in experiences], dtype=torch.float32)  # (N,)
        buckets = getattr(self.cfg.baseline, "buckets", 1)
        keys = [bucket_key(e, buckets, self.assistant_header) for e in experiences]
        adv = advantages(rewards, self.baseline.values(keys, rewards),
                         normalize=self.cfg.normalize_advantages)  # (N,)
        rows = pack_rows(experiences, adv.tolist())  # a session's turns share a row
        batch = TokenBatch.from_sequences([r.tokens for r in rows], [r.mask for r in rows],
                                          pad_id=self.pad_id)
        behavior = batch.pad_like([r.behavior for r in rows])  # (B, T)
        token_adv = batch.pad_like([r.advantage for r in rows])  # (B, T)
        with torch.no_grad():
            ref = (self.logprobs(self.reference, batch, rows) if self.cfg.kl_coef > 0
                   else torch.zeros(batch.tokens.shape))
        logp = self.logprobs(self.model, batch, rows)
        mask = batch.loss_mask.bool()
        if self.cfg.objective == "clipped":
            out = clipped_online_loss(logp, behavior, ref, token_adv, mask, clip=self.cfg.clip,
                                      is_cap=self.cfg.is_cap, kl_coef=self.cfg.kl_coef)
        else:
            out = online_loss(logp, behavior, ref, token_adv, mask, is_cap=self.cfg.is_cap,
                              kl_coef=self.cfg.kl_coef)
        out.loss.backward()
        self.baseline.update(keys, rewards)
        return {**out.metrics(), "reward": float(rewards.mean()),
                "advantage_abs": float(adv.abs().mean()), "rows": float(len(rows))}

    def step(self, experiences: Sequence[ExperienceReady]) -> dict[str, float]:
        """One optimizer step on one batch; records the batch in the ledger."""
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self.forward_backward(experiences)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.ledger.record(LedgerEntry(
            step=self.state.step, experience_ids=[e.experience_id for e in experiences],
            generation_ids=[e.generation_id for e in experiences],
            feedback_event_ids=[i for e in experiences for i in e.feedback_event_ids]))
        self.state.step += 1
        self.last_metrics = {**metrics, "grad_norm": float(norm), "batch": len(experiences)}
        return self.last_metrics

    def state_dict(self) -> dict[str, Any]:
        self.state.baseline = self.baseline.state_dict()
        return {"weights": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "state": dict(self.state.__dict__), "ledger": self.ledger}

    def checkpoint(self) -> str:
        """Durably save everything; after this returns, its offsets may be committed."""
        self.state.sequence += 1
        parts = self.state_dict()
        return self.store.save(sequence=self.state.sequence, **parts)

    def set_reference(self, weights: dict[str, torch.Tensor]) -> None:
        sha = state_dict_sha256(weights)
        self.store.save_reference(sha, weights)
        self.reference.load_state_dict(weights)
        self.state.reference_sha256 = sha

    def export_candidate(self, path: Path) -> Path:
        """Current weights as safetensors (tied tensors as copies), for the release pipeline."""
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({n: t.detach().contiguous().clone()
                   for n, t in self.model.state_dict().items()}, str(tmp))
        tmp.replace(path)
        return path

    def close(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _maybe_replay(model: Any, routes: torch.Tensor | None) -> Any:
    if routes is None:
        return _NullContext()
    from kernels.moe_replay import replay_routes

    return replay_routes(model, routes)


def run_online(settings: Any, **kwargs: Any) -> Any:
    """The `flywheel train-online` process body (trainer/online_loop.py)."""
    from trainer.online_loop import run_online as run

    return run(settings, **kwargs)
