"""An engine in the trainer's own process, on a copy of the policy's weights: for held-out
evaluation and the benches' fixed-task measurements (rollouts for training come from the
fleet: trainer/bootstrap/fleet.py).

    engine = make_engine(policy, cfg, seed=0)
    harness = build_harness(engine, cfg, temperature=0.0)
    load_weights(engine, policy.version, policy.state_dict())   # in place, between steps
"""

from __future__ import annotations

import torch

from kernels.weights import state_dict_sha256
from serving.engine import ModelVersion
from serving.torch_engine import TorchEngine
from simulate.harness import Harness, Segment
from trainer.bootstrap.config import BootstrapSettings
from trainer.policy import Policy

Weights = dict[str, torch.Tensor]


def build_harness(engine: TorchEngine, cfg: BootstrapSettings, *,
                  temperature: float) -> Harness[Segment]:
    return Harness.on_engine(engine, cfg.harness(temperature=temperature))


def make_engine(policy: Policy, cfg: BootstrapSettings, *, seed: int) -> TorchEngine:
    """An engine on a copy of the policy's current weights (batch-invariant if it is)."""
    return TorchEngine(policy.unsharded_model().eval(), policy.tokenizer, seed=seed,
                       max_batch=128, prefix_cache_tokens=cfg.prefix_cache_tokens)


def load_weights(engine: TorchEngine, version: int, state: Weights) -> None:
    """Hot-swap `state` into a running engine between decode steps (no restart)."""
    engine.call_between_steps(lambda model: model.load_state_dict(state)).result()
    engine.set_version(ModelVersion(version, state_dict_sha256(state)))
