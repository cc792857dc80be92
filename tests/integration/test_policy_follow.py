"""A rollout worker's policy follower on a real broker and store: a new version is prepared
and verified while the worker's batch would run, without touching the live weights, and
`catch_up` only writes it in; an announcement whose sha256 its delta does not reach is refused
and the engine stays on what it had."""

from __future__ import annotations

from pathlib import Path

import torch

from ingest.config import KafkaConfig
from ingest.events import ReleasePublished
from ingest.log import EventProducer
from kernels.delta import encode_delta
from kernels.delta.store import artifact_store_config, build_artifact_store, release_prefix
from kernels.weights import state_dict_sha256
from serving.release_subscriber import ReleaseSubscriber
from serving.torch_engine import TorchEngine
from simulate.rollout_worker import load_policy
from tests.integration.helpers import wait_for
from trainer.bootstrap.policy_publisher import PolicyPublisher, model_files
from trainer.policy import Policy


def nudged(policy: Policy, seed: int) -> dict[str, torch.Tensor]:
    """The policy's weights after a small random move (tied weights stay tied)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in policy.model.parameters():
            param.add_(1e-3 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return policy.state_dict()


def test_a_version_is_prepared_ahead_then_committed_and_a_false_one_refused(
        kafka: KafkaConfig, model_dir: Path, tmp_path: Path) -> None:
    policy = Policy.load(model_dir, lr=1e-3)
    store = build_artifact_store(artifact_store_config(str(tmp_path / "policy")))
    v0 = policy.state_dict()
    publisher = PolicyPublisher(store, kafka).start(0, v0, model_files(policy.served.model,
                                                                        policy.tokenizer))
    model, tokenizer, version = load_policy(store, tmp_path / "worker")
    engine = TorchEngine(model, tokenizer)
    engine.set_version(version)
    follower = ReleaseSubscriber(engine, kafka, store, topic=kafka.topics.policy,
                                 auto_swap=False, prepare_ahead=True, poll_timeout_ms=50).start()
    producer = EventProducer(kafka)
    try:
        v1 = nudged(policy, seed=1)
        publisher.publish(1, v1)
        wait_for(lambda: follower.prepared_version == 1, "v1 prepared ahead")
        assert engine.version == version  # prepared, verified, not written
        assert state_dict_sha256(model.state_dict()) == state_dict_sha256(v0)
        record = follower.catch_up()
        assert record is not None and record.version == 1
        assert record.live_sha256 == state_dict_sha256(v1) == engine.version.sha256

        # v2's delta is stored, but its announcement names other weights
        v2 = nudged(policy, seed=2)
        encoded = encode_delta(v1, v2, base_version=1, target_version=2,
                               base_sha256=state_dict_sha256(v1),
                               target_sha256=state_dict_sha256(v2))
        store.write_release(encoded.manifest, encoded.shards)
        producer.send(kafka.topics.policy, "2", ReleasePublished(
            version=2, parent=1, kind="delta", manifest_uri=release_prefix(2, "delta"),
            sha256="0" * 64)).get(timeout=30)
        wait_for(lambda: follower.newest_version == 2, "v2 announced")
        assert follower.catch_up() is None
        assert [r["version"] for r in follower.refused] == [2]
        assert engine.version.number == 1
        assert state_dict_sha256(model.state_dict()) == state_dict_sha256(v1)
    finally:
        producer.close()
        follower.stop()
        publisher.close()
        engine.close()


def test_a_bfloat16_policy_reaches_a_worker_in_bfloat16(
        kafka: KafkaConfig, tmp_path: Path) -> None:
    """The learner's float32 masters stay home: what a worker builds from the store's files
    and the first snapshot is the served bfloat16 policy, bit for bit."""
    from trainer.config import TinyModelSettings
    from trainer.init_model import init_model

    model_dir = init_model(TinyModelSettings(dtype="bfloat16", hidden_size=64, num_layers=2,
                                             head_dim=16, moe_intermediate_size=32),
                           tmp_path / "bf16")
    policy = Policy.load(model_dir, lr=1e-3)
    assert {p.dtype for p in policy.model.parameters()} == {torch.float32}
    store = build_artifact_store(artifact_store_config(str(tmp_path / "policy")))
    v0 = policy.state_dict()
    publisher = PolicyPublisher(store, kafka).start(0, v0, model_files(policy.served.model,
                                                                        policy.tokenizer))
    try:
        model, _, version = load_policy(store, tmp_path / "worker")
        assert {t.dtype for t in model.state_dict().values()} == {torch.bfloat16}
        assert version.sha256 == state_dict_sha256(model.state_dict()) == state_dict_sha256(v0)
    finally:
        publisher.close()
