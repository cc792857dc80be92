"""The weights side of a release: load a candidate, gate it, encode and store it.

Each function is given what it needs (a `ReleaseConfig`, weights); trainer/release/pipeline.py runs
them in order and keeps the history and the announcements.

    weights = load_candidate(path, config.model_dir)
    decision = evaluate(config, served_weights, weights, served_sha256=...,
                        candidate_sha256=state_dict_sha256(weights))
    uris = store_release(config, served_weights, weights, base=..., target=..., snapshot=False)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernels.delta import EncodedRelease, encode_delta, encode_snapshot
from kernels.delta.chain import apply_chain, plan_chain
from kernels.delta.manifest import VersionRef
from kernels.delta.store import ArtifactStore, artifact_store_config, build_artifact_store
from kernels.weights import checkpoint_dtype, state_dict_sha256
from trainer.release.config import ReleaseConfig
from trainer.release.eval_gate import EvalSuite, GateDecision, Scores, build_eval_suite, gate

Weights = dict[str, torch.Tensor]


class ReleaseError(RuntimeError):
    """A release request that cannot proceed (the message says why)."""


@dataclass(frozen=True)
class StoredRelease:
    manifest_uri: str  # the delta (or, for version 0, the snapshot)
    snapshot_uri: str | None


def artifact_store(config: ReleaseConfig) -> ArtifactStore:
    return build_artifact_store(artifact_store_config(config.store_url))


def load_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(model_dir,
                                                dtype=checkpoint_dtype(model_dir)).eval()


def base_weights(model_dir: Path) -> Weights:
    return {n: t.detach().clone() for n, t in load_model(model_dir).state_dict().items()}


def load_candidate(path: Path, base_model_dir: Path) -> Weights:
    """A trainer checkpoint as a full state dict (tied weights included, as the engine has).

    `path` is a Hugging Face model dir or a safetensors state dict; names, shapes and dtypes
    must match the base model's.
    """
    if not path.exists():
        raise ReleaseError(f"candidate checkpoint {path} does not exist")
    if path.is_dir():
        return base_weights(path)
    from safetensors.torch import load_file

    model = load_model(base_model_dir)
    expected = {n: (t.shape, t.dtype) for n, t in model.state_dict().items()}
    loaded = load_file(str(path))
    odd = [n for n, t in loaded.items() if expected.get(n) != (t.shape, t.dtype)]
    if odd:
        raise ReleaseError(f"candidate {path} does not match the model: {odd[:5]}")
    missing, _ = model.load_state_dict(loaded, strict=False)
    state = model.state_dict()
    # a tensor the file lacks is fine where the model ties it to one the file has (an LM head
    # tied to the embeddings): the two names share one storage
    given = {state[n].data_ptr() for n in loaded}
    lacking = sorted(n for n in missing if state[n].data_ptr() not in given)
    if lacking:
        raise ReleaseError(f"candidate {path} lacks tensors: {lacking[:5]}")
    return {n: t.detach().clone() for n, t in state.items()}


def save_weights(weights: Weights, path: Path) -> None:
    """Safetensors without shared storage (tied tensors are written as copies)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous().clone() for n, t in weights.items()}, str(path))


def head_weights(config: ReleaseConfig, version: int, sha256: str) -> Weights:
    """The weights of a published version: the head cache, or rebuilt from the store."""
    if config.head_cache.exists():
        from safetensors.torch import load_file

        weights = load_file(str(config.head_cache))
        if state_dict_sha256(weights) == sha256:
            return weights
    store = artifact_store(config)
    weights = base_weights(config.model_dir)  # any weights of the layout: a snapshot overwrites
    steps = plan_chain(None, version, store.releases())
    apply_chain(weights, steps, lambda info: (store.read_manifest(info.version, info.kind),
                                              store.shard_reader(info.version, info.kind)))
    if state_dict_sha256(weights) != sha256:
        raise ReleaseError(f"v{version}: the store rebuilds other weights")
    save_weights(weights, config.head_cache)
    return weights


def evaluate(config: ReleaseConfig, served: Weights, candidate: Weights, *,
             served_sha256: str, candidate_sha256: str) -> GateDecision:
    """Score both with the configured suite on the base model architecture. Scores are cached
    by the weights' sha256 (the caller's: `state_dict_sha256` of each): one served version
    meets many candidates, and a candidate that ships is the next one's served version."""
    from transformers import AutoTokenizer

    model = load_model(config.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(config.model_dir)
    suite = build_eval_suite(config.release.eval, tasks=config.tasks, harness=config.harness)
    return gate(suite, _scores(config, suite, model, tokenizer, candidate, candidate_sha256),
                _scores(config, suite, model, tokenizer, served, served_sha256))


def _scores(config: ReleaseConfig, suite: EvalSuite, model: Any, tokenizer: Any,
            weights: Weights, sha256: str) -> Scores:
    key = hashlib.sha256(json.dumps([
        config.release.eval.model_dump(mode="json"), config.tasks.model_dump(mode="json"),
        repr(config.harness), sha256]).encode()).hexdigest()
    path = config.cache_dir / "eval" / f"{key}.json"
    if path.exists():
        cached = json.loads(path.read_text())
        return Scores(cached["metrics"], cached["tasks"])
    model.load_state_dict(weights)
    scores = suite.evaluate(model, tokenizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"metrics": scores.metrics, "tasks": scores.tasks}))
    return scores


def _write(config: ReleaseConfig, encoded: EncodedRelease) -> str:
    """Store an encoded release; returns its manifest URI."""
    key = artifact_store(config).write_release(encoded.manifest, encoded.shards)
    return f"{config.store_url.rstrip('/')}/{key}"


def store_base(config: ReleaseConfig, weights: Weights, sha256: str) -> StoredRelease:
    """Version 0: the base model as a full snapshot; it also becomes the head cache."""
    uri = _write(config, encode_snapshot(weights, version=0, sha256=sha256))
    save_weights(weights, config.head_cache)
    return StoredRelease(manifest_uri=uri, snapshot_uri=uri)


def store_release(config: ReleaseConfig, served: Weights, candidate: Weights, *,
                  base: VersionRef, target: VersionRef, snapshot: bool) -> StoredRelease:
    """The delta served -> candidate (and a full snapshot when `snapshot`), in the store."""
    snapshot_uri = _write(config, encode_snapshot(candidate, version=target.version,
                                                  sha256=target.sha256)) if snapshot else None
    manifest_uri = _write(config, encode_delta(
        served, candidate, base_version=base.version, target_version=target.version,
        base_sha256=base.sha256, target_sha256=target.sha256))
    return StoredRelease(manifest_uri=manifest_uri, snapshot_uri=snapshot_uri)
