"""Every Hugging Face family Flywheel supports, on every path, each a tiny random-weight
checkpoint built here from its config with the project's tokenizer (nothing downloaded):

- served by the torch engine with logprobs the trainers reproduce, and MoE routes for the MoE
  families (none for the dense ones);
- in the batch-invariant mode, the engine's logprobs equal the online trainer's bit for bit
  (MoE routes replayed), so its first step has a ratio of exactly 1 and no clipping;
- trained by the online trainer and by the bootstrap's learner (mid-training's next-token loss
  and GRPO's clipped surrogate);
- released: the trainer's candidate through the release pipeline as a bit-exact delta,
  hot-swapped into the serving engine, then rolled back to the base.

The families and their shapes: `trainer/config.py` (`ModelFamily`), `trainer/init_model.py`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import get_args

import pytest
import torch

from app.settings import Settings
from ingest.config import KafkaConfig
from ingest.events import ExperienceReady
from kernels.weights import checkpoint_dtype, state_dict_sha256
from serving.engine import GenerationRequest, GenerationResult, ModelVersion
from serving.torch_engine import TorchEngine
from tests.kernels.helpers import one_thread  # noqa: F401 (autouse: one torch thread)
from tests.trainer.helpers import judged_experience
from trainer.bootstrap.config import BootstrapSettings
from trainer.bootstrap.run import OfflineTrainer
from trainer.config import MOE_FAMILIES, ModelFamily, TinyModelSettings
from trainer.init_model import init_model
from trainer.online.config import BatchMeanBaseline, OnlineTrainerSettings
from trainer.online.trainer import OnlineTrainer
from trainer.policy import NextTokenLoss, Policy, Rows
from trainer.release.config import HeldOutLossEval
from trainer.release.pipeline import build_release, open_release_context, rollback_release
from trainer.release.weights import artifact_store, base_weights, load_candidate

FAMILIES = get_args(ModelFamily)
DTYPES = ("float32", "bfloat16")
PROMPTS = ["def add(a, b):", "Write a function that reverses a string.", "def is_even(n):",
           "class Stack:"]
MAX_TOKENS = 6


@pytest.fixture(scope="module", params=[(f, d) for f in FAMILIES for d in DTYPES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint of the family in the dtype: 2 layers, 64 wide, 8 experts of 32 for
    the MoEs."""
    family, dtype = request.param
    shape = TinyModelSettings(family=family, dtype=dtype, hidden_size=64, num_layers=2,
                              head_dim=16, moe_intermediate_size=32)
    return init_model(shape, tmp_path_factory.mktemp(f"{family}-{dtype}") / "base")


def serve(engine: TorchEngine) -> list[tuple[list[int], GenerationResult]]:
    """The prompts together (one batch), sampled at 1.0 with a seed each."""
    prompts = [engine.tokenizer(p)["input_ids"] for p in PROMPTS]

    async def all_of() -> list[GenerationResult]:
        return await asyncio.gather(*(engine.generate(GenerationRequest(
            prompt_token_ids=p, max_tokens=MAX_TOKENS, seed=i)) for i, p in enumerate(prompts)))
    return list(zip(prompts, asyncio.run(all_of()), strict=True))


def experiences(served: list[tuple[list[int], GenerationResult]]) -> list[ExperienceReady]:
    """What the join would make of the generations: a reward from a hidden preference."""
    return [judged_experience(prompt, r.token_ids, r.logprobs, r.routed_experts,
                              temperature=1.0, max_tokens=MAX_TOKENS,
                              finish_reason=r.finish_reason, model_version=r.version.number,
                              model_sha256=r.version.sha256) for prompt, r in served]


def online(model_dir: Path, root: Path, *, batch_invariant: bool = False) -> OnlineTrainer:
    cfg = OnlineTrainerSettings(min_batch=4, max_batch=4, lr=1e-3, deterministic=True,
                                baseline=BatchMeanBaseline())
    return OnlineTrainer.restore(cfg, model_dir, root, batch_invariant=batch_invariant)


def moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> int:
    return sum(not torch.equal(t, after[n]) for n, t in before.items())


def test_served_with_logprobs_the_trainer_reproduces_and_moe_routes(family_dir: Path,
                                                                    tmp_path: Path) -> None:
    engine = TorchEngine.load(family_dir, threads=1, max_batch=4)
    try:
        served = serve(engine)
    finally:
        engine.close()
    config = engine.model.config
    for prompt, result in served:
        assert len(result.token_ids) == len(result.logprobs) > 0
        if config.model_type in MOE_FAMILIES:
            assert result.routed_experts is not None
            assert result.routed_experts.shape == (
                len(prompt) + len(result.token_ids) - 1, config.num_hidden_layers,
                config.num_experts_per_tok)
        else:
            assert result.routed_experts is None
    trainer = online(family_dir, tmp_path)
    metrics = trainer.step(experiences(served))
    assert metrics["batch"] == 4
    # the same weights, to the dtype's noise (other kernels, another batch)
    bf16 = checkpoint_dtype(family_dir) == torch.bfloat16
    assert metrics["ratio"] == pytest.approx(1.0, abs=0.05 if bf16 else 1e-3)
    # float32 master weights; what is trained on and published is them rounded to the dtype
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    for master, copy in zip(trainer.model.parameters(), trainer.served.model.parameters(),
                            strict=True):
        assert copy.dtype == checkpoint_dtype(family_dir)
        assert torch.equal(copy, master.to(copy.dtype))


def test_batch_invariant_engine_and_trainer_agree_bit_for_bit(family_dir: Path,
                                                              tmp_path: Path) -> None:
    engine = TorchEngine.load(family_dir, threads=1, max_batch=4, batch_invariant=True)
    try:
        served = serve(engine)
    finally:
        engine.close()
    trainer = online(family_dir, tmp_path, batch_invariant=True)
    metrics = trainer.step(experiences(served))
    assert (metrics["ratio"], metrics["clipped"], metrics["kl"]) == (1.0, 0.0, 0.0)


def test_the_bootstrap_learner_trains_it(family_dir: Path) -> None:
    engine = TorchEngine.load(family_dir, threads=1, max_batch=4)
    try:
        served = serve(engine)
    finally:
        engine.close()
    rows = Rows([], [], [], [])
    for prompt, result in served:
        rows.sequences.append(prompt + result.token_ids)
        rows.masks.append([0.0] * len(prompt) + [1.0] * len(result.token_ids))
        rows.behavior.append([0.0] * len(prompt) + result.logprobs)  # type: ignore[union-attr]
        rows.advantages.append(1.0 if result.token_ids[0] % 2 == 0 else -1.0)  # type: ignore
    policy = Policy.load(family_dir, lr=1e-3)
    before = {n: t.clone() for n, t in policy.state_dict().items()}
    policy.train_step(dataclasses.replace(rows, behavior=None, advantages=None),
                      NextTokenLoss(), 1e-3)
    policy.train_step(rows, OfflineTrainer.from_settings(policy, BootstrapSettings()).objective,
                      1e-3)
    assert policy.version == 2
    assert moved(before, policy.state_dict()) > 0


def test_released_as_a_bit_exact_delta_hot_swapped_and_rolled_back(
        family_dir: Path, kafka: KafkaConfig, tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", kafka_bootstrap=kafka.bootstrap,
                        topics=kafka.topics, model_dir=family_dir, port=0)
    settings = settings.model_copy(update={"release": settings.release.model_copy(
        update={"eval": HeldOutLossEval()})})  # random weights solve no task: gate on loss
    engine = TorchEngine.load(family_dir, threads=1, max_batch=4)
    try:
        trainer = online(family_dir, tmp_path / "trainer")
        trainer.step(experiences(serve(engine)))
        candidate = trainer.export_candidate(tmp_path / "candidate.safetensors")
        trained = load_candidate(candidate, family_dir)
        with open_release_context(settings.release_config()) as ctx:
            release = build_release(ctx, candidate=candidate, requested_by="test")
            assert (release.status, release.kind, release.version) == ("published", "delta", 1)
            assert release.sha256 == state_dict_sha256(trained)
            store = artifact_store(ctx.config)
            engine.swap_to(store, ModelVersion(1, release.sha256))
            live = engine.live_weights()
            assert state_dict_sha256(live) == release.sha256  # bit-exact in the replica
            assert all(torch.equal(live[n], t) for n, t in trained.items())
            assert serve(engine)[0][1].version.number == 1
            back = rollback_release(ctx, 1, requested_by="test", reason="conformance")
            assert back.version == 0
            engine.swap_to(store, ModelVersion(0, back.sha256))
            assert state_dict_sha256(engine.live_weights()) \
                == state_dict_sha256(base_weights(family_dir))
    finally:
        engine.close()
