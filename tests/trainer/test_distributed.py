"""FSDP2 on 2 gloo ranks: the same online steps as one process, a release that applies bit for
bit, a sharded checkpoint that resumes at another world size.

Two CPU ranks are started by `trainer.distributed.launch` (torch's elastic agent, as
`flywheel train-online --nproc 2` does), one thread each. The leader steps the trainer on three
batches (8, 7 and 1 experiences: even, odd, and one that leaves rank 1 a row with nothing in
its loss), exports the candidate and checkpoints; rank 1 follows.

Parity holds to 1.2e-7 here. AdamW's epsilon is 1e-4 in these tests, not torch's 1e-8: Adam
moves every weight whose gradient is nonzero by about lr in its first steps, whatever the
gradient's size, so an element whose gradient is rounding noise (a different summation order,
here ranks; as well a different thread count) gets a full ±lr step of random sign. With 1e-8,
some 70 of 2M elements differ by up to 3e-5; eps bounds that noise to lr * noise / eps.

    OMP_NUM_THREADS=1 python -m pytest tests/trainer/test_distributed.py
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ingest.events import ExperienceReady
from kernels.delta import apply_delta, encode_delta
from kernels.weights import state_dict_sha256
from tests.trainer.helpers import make_experiences
from trainer.bootstrap.config import BootstrapSettings
from trainer.bootstrap.run import OfflineTrainer
from trainer.distributed import World, join_world, launch, leave_world
from trainer.online.config import FormatAnchorSettings, OnlineTrainerSettings
from trainer.online.trainer import OnlineTrainer
from trainer.policy import NextTokenLoss, Policy, Rows
from trainer.release.weights import base_weights, load_candidate

SIZES = (8, 7, 1)
EPS = 1e-4


# the format anchor on: every rank computes it on the same episodes, and FSDP's mean of the
# ranks' gradients must be its gradient (confidence ~0 holds every position of the tiny model)
ANCHOR = FormatAnchorSettings(coef=1.0, rows=2, confidence=1e-6)


def _cfg(**kw: object) -> OnlineTrainerSettings:
    return OnlineTrainerSettings(lr=1e-3, deterministic=True, kl_coef=0.05, adam_eps=EPS,
                                 anchor=ANCHOR, **kw)  # type: ignore[arg-type]


def _rank(model_dir: str, batches: list[list[ExperienceReady]], out: str,
          cpu: bool = True, batch_invariant: bool = False) -> None:
    """One rank of the sharded trainer (a `launch` entry point); gloo on the CPU, or with
    `cpu=False` NCCL on a GPU where there is one."""
    world = join_world(timeout_s=120, cpu=cpu)
    try:
        trainer = OnlineTrainer.restore(_cfg(), Path(model_dir), Path(out) / "ckpt",
                                        world=world, batch_invariant=batch_invariant)
        if not world.leader:
            trainer.follow()
            return
        for batch in batches:
            trainer.step(batch)
        trainer.export_candidate(Path(out) / "candidate.safetensors")
        trainer.checkpoint()
        trainer.finish()
    finally:
        leave_world(world)


def _refusing_rank(model_dir: str, batches: list[list[ExperienceReady]], out: str) -> None:
    """One rank of a sharded trainer that hands a candidate over (stashed: the KL anchor from
    then on), trains on from it, then has it refused: every rank goes back to the served
    weights, named by the leader."""
    world = join_world(timeout_s=120, cpu=True)
    try:
        trainer = OnlineTrainer.restore(_cfg(), Path(model_dir), Path(out) / "ckpt",
                                        world=world)
        if not world.leader:
            trainer.follow()
            return
        served = trainer.state.served_sha256 or ""
        trainer.step(batches[0])
        trainer.adopt_stashed(trainer.stash())
        trainer.step(batches[1])
        trainer.revert_to_served(served)
        trainer.export_candidate(Path(out) / "candidate.safetensors")
        trainer.finish()
    finally:
        leave_world(world)


@pytest.fixture(scope="module")
def batches(model_dir: Path) -> list[list[ExperienceReady]]:
    experiences = make_experiences(model_dir, sum(SIZES), seed=5)
    starts = [sum(SIZES[:i]) for i in range(len(SIZES))]
    return [experiences[s:s + n] for s, n in zip(starts, SIZES, strict=True)]


@pytest.fixture(scope="module")
def two_ranks(model_dir: Path, batches: list[list[ExperienceReady]],
              tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp2")
    launch(2, _rank, str(model_dir), batches, str(out), max_restarts=0)
    return out


def _one_process(model_dir: Path, root: Path, device: str = "cpu",
                 batch_invariant: bool = False) -> OnlineTrainer:
    threads = torch.get_num_threads()
    try:
        return OnlineTrainer.restore(_cfg(), model_dir, root, batch_invariant=batch_invariant,
                                     world=World(device=torch.device(device)))
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)


@pytest.mark.timeout(300)
def test_two_ranks_step_like_one_process_on_the_full_batch(
        two_ranks: Path, model_dir: Path, batches: list[list[ExperienceReady]],
        tmp_path: Path) -> None:
    trainer = _one_process(model_dir, tmp_path / "ckpt")
    for batch in batches:
        trainer.step(batch)
    sharded = load_candidate(two_ranks / "candidate.safetensors", model_dir)
    base = base_weights(model_dir)
    moved = 0
    for name, tensor in trainer.model.state_dict().items():
        torch.testing.assert_close(sharded[name], tensor, rtol=0, atol=1e-6, msg=name)
        moved += int(not torch.equal(tensor, base[name]))
    assert moved > 0, "three steps changed nothing: the comparison would prove nothing"


@pytest.mark.timeout(300)
def test_batch_invariant_kernels_and_route_replay_under_fsdp2(
        model_dir: Path, batches: list[list[ExperienceReady]], tmp_path: Path) -> None:
    """The switch is per module and the routes per token: both hold on sharded blocks (the
    experiences carry their routes, which every step replays)."""
    assert all(e.routed_experts is not None for b in batches for e in b)
    launch(2, _rank, str(model_dir), batches, str(tmp_path), True, True, max_restarts=0)
    trainer = _one_process(model_dir, tmp_path / "one", batch_invariant=True)
    for batch in batches:
        trainer.step(batch)
    sharded = load_candidate(tmp_path / "candidate.safetensors", model_dir)
    for name, tensor in trainer.model.state_dict().items():
        torch.testing.assert_close(sharded[name], tensor, rtol=0, atol=1e-6, msg=name)


def _policy_rows(batches: list[list[ExperienceReady]]) -> list[Rows]:
    """The experiences as the bootstrap's rows: whole sequences, completion tokens trained,
    their behavior logprobs, an advantage of ±1."""
    out = []
    for batch in batches:
        rows = Rows([], [], [], [])
        for e in batch:
            prompt, completion = e.prompt_token_ids.tolist(), e.completion_token_ids.tolist()
            rows.sequences.append(prompt + completion)
            rows.masks.append([0.0] * len(prompt) + [1.0] * len(completion))
            rows.behavior.append([0.0] * len(prompt) + e.logprobs.tolist())  # type: ignore
            rows.advantages.append(e.reward)  # type: ignore[union-attr]
        out.append(rows)
    return out


def _policy_steps(policy: Policy, rows: list[Rows]) -> None:
    """One mid-training step, then GRPO steps: the bootstrap's two objectives."""
    grpo = OfflineTrainer.from_settings(policy, BootstrapSettings()).objective
    policy.train_step(dataclasses.replace(rows[0], behavior=None, advantages=None),
                      NextTokenLoss(), 1e-3)
    for batch in rows:
        policy.train_step(batch, grpo, 1e-3)


def _policy_rank(model_dir: str, rows: list[Rows], out: str) -> None:
    """One rank of the bootstrap's sharded learner (a `launch` entry point)."""
    world = join_world(timeout_s=120, cpu=True)
    try:
        torch.set_num_threads(1)
        policy = Policy.load(Path(model_dir), lr=1e-3, world=world, adam_eps=EPS)
        if not world.leader:
            policy.follow()
            return
        _policy_steps(policy, rows)
        policy.save(Path(out) / "model")
        policy.finish()
    finally:
        leave_world(world)


@pytest.mark.timeout(300)
def test_the_bootstraps_learner_on_two_ranks_steps_like_one_process(
        model_dir: Path, batches: list[list[ExperienceReady]], tmp_path: Path) -> None:
    """Mid-training's next-token loss and GRPO's clipped surrogate, each on 2 gloo ranks,
    against one process on the full batches; the leader saves the model whole."""
    rows = _policy_rows(batches)
    launch(2, _policy_rank, str(model_dir), rows, str(tmp_path), max_restarts=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        policy = Policy.load(model_dir, lr=1e-3, adam_eps=EPS)
        _policy_steps(policy, rows)
    finally:
        torch.set_num_threads(threads)
    sharded = base_weights(tmp_path / "model")
    base = base_weights(model_dir)
    for name, tensor in policy.model.state_dict().items():
        torch.testing.assert_close(sharded[name], tensor, rtol=0, atol=1e-6, msg=name)
        assert not torch.equal(tensor, base[name]), name


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_one_gpu_rank_on_nccl_steps_like_one_process(
        model_dir: Path, batches: list[list[ExperienceReady]], tmp_path: Path) -> None:
    """FSDP2 on a world of one NCCL rank against the plain trainer, both on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    launch(1, _rank, str(model_dir), batches, str(tmp_path), False, max_restarts=0)
    trainer = _one_process(model_dir, tmp_path / "one", device="cuda")
    for batch in batches:
        trainer.step(batch)
    sharded = load_candidate(tmp_path / "candidate.safetensors", model_dir)
    for name, tensor in trainer.model.state_dict().items():
        torch.testing.assert_close(sharded[name], tensor.cpu(), rtol=0, atol=1e-6, msg=name)


@pytest.mark.timeout(300)
def test_a_release_from_two_ranks_applies_bit_for_bit(two_ranks: Path, model_dir: Path
                                                      ) -> None:
    base = base_weights(model_dir)
    candidate = load_candidate(two_ranks / "candidate.safetensors", model_dir)
    release = encode_delta(base, candidate, base_version=0, target_version=1)
    live = {name: t.clone() for name, t in base.items()}  # a replica at version 0
    apply_delta(live, release.manifest, release.shards.__getitem__)
    assert state_dict_sha256(live) == state_dict_sha256(candidate)
    assert all(torch.equal(live[n], candidate[n]) for n in candidate)


@pytest.mark.timeout(300)
def test_a_refused_candidate_sends_every_rank_back_to_the_served_weights(
        model_dir: Path, batches: list[list[ExperienceReady]], tmp_path: Path) -> None:
    launch(2, _refusing_rank, str(model_dir), batches, str(tmp_path), max_restarts=0)
    base = base_weights(model_dir)
    candidate = load_candidate(tmp_path / "candidate.safetensors", model_dir)
    assert all(torch.equal(candidate[n], base[n]) for n in base)


@pytest.mark.timeout(300)
def test_a_two_rank_checkpoint_resumes_in_one_process(two_ranks: Path, model_dir: Path
                                                      ) -> None:
    trainer = _one_process(model_dir, two_ranks / "ckpt")
    candidate = load_candidate(two_ranks / "candidate.safetensors", model_dir)
    assert trainer.state.step == len(SIZES)
    assert trainer.ledger.trained == sum(SIZES)
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor, candidate[name]), name
    moments = [s["exp_avg"] for s in trainer.optimizer.state.values()]
    assert moments and any(bool(m.abs().sum() > 0) for m in moments)


@pytest.mark.timeout(300)
def test_bfloat16_weights_on_two_ranks_step_like_one_process(
        model_dir: Path, batches: list[list[ExperienceReady]], tmp_path: Path) -> None:
    """A checkpoint served in bfloat16 (trainer/precision.py): each rank steps its float32
    master shard from the gradients of its bfloat16 copy's forward and backward, and the leader
    exports the bfloat16 candidate. Against one process on the full batches. The gradients are
    the bfloat16 copy's: each rank's partial sums are rounded before the ranks' are added, and
    the embedding's gradient is summed token by token in bfloat16, so the steps differ by
    bfloat16's rounding, not float32's: the masters (the checkpoint's) agree within 30% of
    each tensor's largest move over the three steps (measured: 2-9% for the projections and
    experts, 24% for the tied embedding), and each candidate is its masters rounded."""
    from app.settings import Settings
    from trainer.init_model import init_model

    bf16_dir = init_model(Settings().model.model_copy(update={"dtype": "bfloat16"}),
                          tmp_path / "bf16")
    launch(2, _rank, str(bf16_dir), batches, str(tmp_path / "ranks"), max_restarts=0)
    one = _one_process(bf16_dir, tmp_path / "one")
    start = {n: t.clone() for n, t in one.model.state_dict().items()}
    for batch in batches:
        one.step(batch)
    resumed = _one_process(bf16_dir, tmp_path / "ranks" / "ckpt")  # the ranks' masters
    assert resumed.state.step == len(SIZES)
    for name, tensor in one.model.state_dict().items():
        assert tensor.dtype == torch.float32, name
        moved = float((tensor - start[name]).abs().max())
        apart = float((resumed.model.state_dict()[name] - tensor).abs().max())
        assert moved > 0 and apart <= 0.3 * moved, (name, apart, moved)
    candidate = load_candidate(tmp_path / "ranks" / "candidate.safetensors", bf16_dir)
    masters = resumed.model.state_dict()
    for name, tensor in one.served.model.state_dict().items():  # published: masters rounded
        assert candidate[name].dtype == tensor.dtype == torch.bfloat16, name
        assert torch.equal(candidate[name], masters[name].to(torch.bfloat16)), name
        assert torch.equal(tensor, one.model.state_dict()[name].to(torch.bfloat16)), name
