"""The online trainer: joined live feedback in (`experiences`), a better policy out.

Each step takes a batch of `ExperienceReady` records (at least `online.min_batch`), recomputes
the logprobs of the served tokens with the logged MoE routes replayed, and applies the online
objective of `trainer/online/loss.py` (baseline advantage, PPO's clip anchored at the behavior
logprobs, k3 KL anchor to the served release), with gradient clipping.

Crash safety (trainer/checkpoint.py): the consumer is assigned all partitions by hand and seeks
to the offsets stored in the latest checkpoint; a step's weights, optimizer, offsets and ledger
are checkpointed together; Kafka offsets are committed only after that checkpoint is durable;
records whose experience ids are in the ledger are skipped (a session verdict yields
several experiences under one feedback event id). The loop around
the trainer (consumer, batching, control, releases) is trainer/online/loop.py.

Over N ranks (trainer/distributed.py) the model and the optimizer are sharded with FSDP2.
The leader (rank 0) alone reads Kafka and runs the loop; each collective phase it enters
(`step`, `checkpoint`, `export_candidate`, `stash`, `adopt_stashed`) it
first announces, with its
arguments, and the other ranks, in `follow`, enter the same phase (`Phases`). Every rank
holds the whole batch, so advantages and baselines are the same everywhere; rank r trains rows
r, r+N, …, its loss scaled so that FSDP's mean of the ranks' gradients is the gradient of the
token mean over the whole batch: the same step as one process.

    flywheel train-online --data-dir data [--nproc N]
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ingest.events import ExperienceReady
from ingest.topic_reader import Offsets
from kernels.moe_replay import stack_logged_routes
from kernels.weights import checkpoint_dtype, state_dict_sha256
from trainer.checkpoint import CheckpointStore, Ledger, LedgerEntry
from trainer.distributed import (
    Phases,
    World,
    collective,
    full_state_dict,
    grad_norm,
    load_full_state_dict,
    shard,
)
from trainer.online.anchor import FormatAnchor
from trainer.online.baseline import bucket_key, build_baseline
from trainer.online.batch import Row, pack_rows
from trainer.online.config import OnlineTrainerSettings
from trainer.online.loss import OnlineLoss, advantages, clipped_online_loss, online_loss
from trainer.policy import TokenBatch, sequence_logprobs
from trainer.precision import ServedCopy

log = logging.getLogger(__name__)


# ---- the trainer -------------------------------------------------------------------------
@dataclass
class TrainerState:
    """Everything besides weights and optimizer that a resume needs (JSON in the checkpoint)."""

    step: int = 0
    sequence: int = 0  # checkpoint number
    offsets: Offsets = field(default_factory=dict)
    baseline: dict[str, Any] = field(default_factory=dict)
    reference_sha256: str | None = None  # the KL anchor: the newest release handed over
    served_sha256: str | None = None  # what serves every session: a refusal's way back
    release_from_step: int = 0  # first step not contained in a release yet
    last_release: dict[str, Any] | None = None
    published_at: list[float] = field(default_factory=list)  # unix times, oldest first
    last_release_wall: float = field(default_factory=time.time)
    last_release_step: int = 0  # the step the last release was cut at (published or not)
    warmup_from: int = 0  # the step the rate last began warming up (start, or a refusal)
    # the release in its canary (trainer/online/loop.py): version, parent, stashed sha256
    canary: dict[str, Any] | None = None
    # versions whose experiences are stale whatever their time: a canary's parent's under
    # `max_staleness` 0 (its arm), a rolled-back canary's
    stale_versions: list[int] = field(default_factory=list)


def configure_torch(cfg: OnlineTrainerSettings) -> None:
    torch.manual_seed(cfg.seed)
    if cfg.deterministic:
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
    elif cfg.threads:
        torch.set_num_threads(cfg.threads)


class OnlineTrainer:
    """One policy, its optimizer, the KL reference, the baseline, the ledger; named phases.

    `model` and `reference` come sharded (or whole in the one-process world) and on
    `world.device`; `reference_sha256` is the sha256 of the reference's whole weights."""

    def __init__(self, cfg: OnlineTrainerSettings, model: Any, reference: Any, pad_id: int,
                 store: CheckpointStore, *, assistant_header: Sequence[int] = (),
                 world: World | None = None, reference_sha256: str | None = None,
                 served: Any | None = None, anchor: FormatAnchor | None = None) -> None:
        self.cfg = cfg
        self.world = world or World()
        self.phases = Phases(self.world)
        self.assistant_header = list(assistant_header)  # where a conversation's opening ends
        self.model = model.train()  # float32 master weights: the optimizer's, the checkpoint's
        # the weights in the served dtype (`model` itself in float32): forward, backward and
        # everything published (trainer/precision.py)
        self.served = ServedCopy(self.model, (served if served is not None else model).train())
        self.reference = reference.eval().requires_grad_(False)
        self.pad_id = pad_id
        self.anchor = anchor  # the format anchor (trainer/online/anchor.py), when its coef > 0
        self.store = store
        self.optimizer = self._new_optimizer()
        self.baseline = build_baseline(cfg.baseline)
        self.state = TrainerState(reference_sha256=reference_sha256,
                                  served_sha256=reference_sha256)
        self.ledger = Ledger()
        self.last_metrics: dict[str, float] = {}

    def _new_optimizer(self) -> torch.optim.AdamW:
        return torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr, betas=(0.9, 0.99),
                                 eps=self.cfg.adam_eps, weight_decay=self.cfg.weight_decay)

    @classmethod
    def restore(cls, cfg: OnlineTrainerSettings, model_dir: Path, root: Path, *,
                batch_invariant: bool = False, world: World | None = None) -> OnlineTrainer:
        """Build from the base model (sharded over `world`), then load the latest checkpoint
        under `root` if any; `batch_invariant`: the same kernels as a serving engine in that
        mode."""
        import copy

        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from simulate.harness import ChatTokens

        world = world or World()
        hf_logging.disable_progress_bar()
        configure_torch(cfg)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        header = ChatTokens(tokenizer).open("assistant")
        if not world.sharded:  # sharded, each block moves its own shard to the device
            model = model.to(world.device)  # type: ignore[arg-type]  # transformers' stub
        if batch_invariant:  # per module: FSDP2's hooks wrap the patched forwards
            from kernels.batch_invariant import enable_batch_invariant

            enable_batch_invariant(model)
        served = ServedCopy.of(model, checkpoint_dtype(model_dir))
        base_sha = state_dict_sha256(served.model.state_dict())  # whole, before it is sharded
        reference = copy.deepcopy(served.model)
        store = CheckpointStore(root, keep=cfg.keep_checkpoints)
        # a first start stashes the base weights: what a refusal goes back to until a release
        if world.leader and store.latest_name() is None:
            store.save_reference(base_sha, full_state_dict(served.model, World()))
        pad_id = int(model.config.pad_token_id)
        anchor = (FormatAnchor.build(cfg.anchor, tokenizer, pad_id) if cfg.anchor.coef > 0
                  else None)
        trainer = cls(cfg, shard(model, world), shard(reference, world), pad_id, store,
                      assistant_header=header, world=world, reference_sha256=base_sha,
                      served=shard(served.model, world) if served.separate else None,
                      anchor=anchor)
        trainer.load_latest()
        return trainer

    def load_latest(self) -> bool:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        ckpt = self.store.load()
        if ckpt is None:
            return False
        base_sha = self.state.reference_sha256
        weights, optimizer = get_state_dict(self.model, self.optimizer)
        self.store.load_tensors(ckpt, {"weights": weights, "optimizer": optimizer})  # in place
        set_state_dict(self.model, self.optimizer, model_state_dict=weights,
                       optim_state_dict=optimizer)
        self.served.refresh()
        self.state = TrainerState(**{"served_sha256": ckpt.state.get("reference_sha256"),
                                     **ckpt.state})
        self.baseline.load_state_dict(self.state.baseline)
        self.ledger = ckpt.ledger
        if self.state.reference_sha256 != base_sha:
            load_full_state_dict(self.reference, self.store.load_reference(
                self.state.reference_sha256 or ""), self.world)
        log.info("resumed %s at step %d", ckpt.name, self.state.step)
        return True

    # -- the leader's phases, mirrored on every rank (trainer/distributed.py Phases) -------
    def follow(self) -> None:
        """A rank other than the leader: run the phases the leader enters, until `finish`."""
        self.phases.follow(self)

    def tick(self) -> None:
        self.phases.tick()

    def finish(self) -> None:
        self.phases.finish()

    # -- phases ------------------------------------------------------------------------------
    def logprobs(self, model: Any, batch: TokenBatch, rows: Sequence[Row]) -> torch.Tensor:
        """(B, T) logprobs of every token, per-row temperature, logged routes replayed."""
        temps = torch.tensor([r.temperature for r in rows], device=batch.tokens.device)
        routes = self._routes(rows, batch.tokens.shape[1])
        return sequence_logprobs(model, batch, temperature=temps, routes=routes)

    def _routes(self, rows: Sequence[Row], length: int) -> torch.Tensor | None:
        """The logged routes to replay; a row logged without routes (a backend that cannot
        capture them, `GenerationLogged.routes_absent`) is all NO_ROUTE: its router decides."""
        if not self.cfg.router_replay:
            return None
        routes = stack_logged_routes(
            [None if r.routes is None else r.routes.unpack() for r in rows], length)
        return None if routes is None else routes.to(self.world.device)  # (B, T, L, K)

    def _my_rows(self, rows: list[Row]) -> list[Row]:
        """Rows r, r+N, … of the batch; a rank left without any trains a copy of the first
        row with nothing in its loss, so that every rank runs the same collectives."""
        mine = rows[self.world.rank::self.world.size]
        return mine or [dataclasses.replace(rows[0], mask=[0.0] * len(rows[0].mask))]

    def forward_backward(self, experiences: Sequence[ExperienceReady]) -> dict[str, float]:
        rewards = torch.tensor([e.reward for e in experiences], dtype=torch.float32)  # (N,)
        buckets = getattr(self.cfg.baseline, "buckets", 1)
        keys = [bucket_key(e, buckets, self.assistant_header) for e in experiences]
        adv = advantages(rewards, self.baseline.values(keys, rewards),
                         normalize=self.cfg.normalize_advantages)  # (N,)
        rows = pack_rows(experiences, adv.tolist())  # a session's turns share a row
        width = max(len(r.tokens) for r in rows)
        total_tokens = sum(sum(r.mask) for r in rows)
        mine = self._my_rows(rows)
        batch = TokenBatch.from_sequences([r.tokens for r in mine], [r.mask for r in mine],
                                          pad_id=self.pad_id, width=width)
        behavior = batch.pad_like([r.behavior for r in mine])  # (B, T)
        token_adv = batch.pad_like([r.advantage for r in mine])  # (B, T)
        batch, behavior, token_adv = (batch.to(self.world.device), behavior.to(self.world.device),
                                      token_adv.to(self.world.device))
        with torch.no_grad():
            ref = (self.logprobs(self.reference, batch, mine) if self.cfg.kl_coef > 0
                   else torch.zeros_like(behavior))
        logp = self.logprobs(self.served.model, batch, mine)
        out = self._loss(logp, behavior, ref, token_adv, batch.loss_mask.bool())
        my_tokens = float(batch.loss_mask.sum())
        # the token mean over the whole batch, after FSDP averages the ranks' gradients
        (out.loss * self.world.loss_share(my_tokens, total_tokens)).backward()
        self.baseline.update(keys, rewards)
        anchored: dict[str, float] = {}
        if self.anchor is not None:  # every rank the same rows: FSDP's mean is this gradient
            anchor_loss, anchored = self.anchor.loss(self.served.model, self.reference,
                                                     self.state.step, self.world.device)
            anchor_loss.backward()
        return {**self.world.batch_means(out.metrics(), my_tokens), **anchored,
                "reward": float(rewards.mean()), "advantage_abs": float(adv.abs().mean()),
                "rows": float(len(rows))}

    def _loss(self, logp: torch.Tensor, behavior: torch.Tensor, ref: torch.Tensor,
              adv: torch.Tensor, mask: torch.Tensor) -> OnlineLoss:
        if self.cfg.objective == "clipped":
            return clipped_online_loss(logp, behavior, ref, adv, mask, clip=self.cfg.clip,
                                       is_cap=self.cfg.is_cap, kl_coef=self.cfg.kl_coef)
        return online_loss(logp, behavior, ref, adv, mask, is_cap=self.cfg.is_cap,
                           kl_coef=self.cfg.kl_coef)

    @collective
    def step(self, experiences: Sequence[ExperienceReady]) -> dict[str, float]:
        """One optimizer step on one batch; records the batch in the ledger."""
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self.forward_backward(experiences)
        self.served.gradients_to_master()
        norm = grad_norm(self.model, self.cfg.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr * warmup_factor(self.state.step - self.state.warmup_from,
                                                      self.cfg.warmup_steps)
        self.optimizer.step()
        self.served.refresh()
        self.ledger.record(LedgerEntry(
            step=self.state.step, experience_ids=[e.experience_id for e in experiences],
            generation_ids=[e.generation_id for e in experiences],
            feedback_event_ids=[i for e in experiences for i in e.feedback_event_ids]))
        self.state.step += 1
        self.last_metrics = {**metrics, "grad_norm": norm, "batch": len(experiences)}
        return self.last_metrics

    @collective
    def checkpoint(self) -> str:
        """Durably save everything; after this returns, its offsets may be committed."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.state.sequence += 1
        self.state.baseline = self.baseline.state_dict()
        weights, optimizer = get_state_dict(self.model, self.optimizer)
        return self.store.save(sequence=self.state.sequence,
                               tensors={"weights": weights, "optimizer": optimizer},
                               state=dict(self.state.__dict__), ledger=self.ledger,
                               world=self.world, references={
                                   sha for sha in (self.state.reference_sha256,
                                                   self.state.served_sha256) if sha})

    @collective
    def revert_to_served(self, sha256: str) -> None:
        """Back to the release that serves every session, stashed under `sha256` (the gate
        refused a candidate, or its canary rolled it back: training on from its weights would
        carry its drift into the next one): its weights become the policy's and the KL
        reference's again, with fresh AdamW moments and the rate warming up again. (The sha256
        is an argument, as every phase's input is: the other ranks' state is not the
        leader's.)"""
        weights = self.store.load_reference(sha256)
        load_full_state_dict(self.reference, weights, self.world)
        self.state.reference_sha256 = sha256
        dtypes = {name: t.dtype for name, t in self.model.state_dict().items()}
        load_full_state_dict(self.model, {name: t.to(dtypes[name]) for name, t in
                                          weights.items()}, self.world)  # the masters: upcast
        self.served.refresh()
        self.optimizer = self._new_optimizer()
        self.state.warmup_from = self.state.step

    @collective
    def stash(self) -> str:
        """Store the current weights under their sha256 and return it (a candidate handed to
        the release pipeline: the KL reference from then on, `adopt_stashed`)."""
        return self._store_weights()

    @collective
    def adopt_stashed(self, sha256: str) -> None:
        """The weights `stash` stored under `sha256` become the KL reference."""
        if sha256 != self.state.reference_sha256:
            load_full_state_dict(self.reference, self.store.load_reference(sha256), self.world)
            self.state.reference_sha256 = sha256

    def _store_weights(self) -> str:
        weights = full_state_dict(self.served.model, self.world)
        sha = state_dict_sha256(weights) if self.world.leader else None
        if sha is not None:
            self.store.save_reference(sha, weights)
        del weights
        return self.world.broadcast(sha) or ""

    @collective
    def export_candidate(self, path: Path) -> Path:
        """Current weights in the served dtype as safetensors (tied tensors as copies), for
        the release pipeline; gathered to the leader, which alone writes the file."""
        from safetensors.torch import save_file

        weights = full_state_dict(self.served.model, self.world)
        if self.world.leader:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            save_file({n: t.contiguous() for n, t in weights.items()}, str(tmp))
            tmp.replace(path)
        self.world.barrier()
        return path

    def close(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


def warmup_factor(step: int, warmup_steps: int) -> float:
    """The rate's share at (0-based) `step`: rising linearly to 1 over `warmup_steps`."""
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
