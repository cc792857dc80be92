"""The release pipeline, callable with or without Celery (app/tasks.py wraps it).

`build_release`: candidate checkpoint -> eval gate against the served version -> delta (and a
full snapshot every `release.snapshot_every` releases, which resets the chain) in the artifact
store -> `ReleasePublished` on `releases` -> the SQL row marked published. A rejected candidate
is recorded with the reason and never published. `rollback_release` takes the current head
back to its parent by re-announcing the parent: replicas apply the same delta backwards.

The served version ("head") is the newest published release; version 0 is the base model,
recorded as a snapshot the first time the pipeline runs. The head's weights are cached under
`<data_dir>/releases/head.safetensors` and rebuilt from the store when the cache is stale.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import Engine as DbEngine
from sqlmodel import Session, col, select

from app.db import Release
from app.settings import Settings
from ingest.events import ReleasePublished, utcnow
from ingest.log import EventProducer
from kernels.delta import encode_delta, encode_snapshot
from kernels.delta.chain import apply_chain, plan_chain
from kernels.delta.store import ArtifactStore, artifact_store_config, build_artifact_store
from kernels.weights import state_dict_sha256
from trainer.eval_gate import build_eval_suite, gate

log = logging.getLogger(__name__)
Weights = dict[str, torch.Tensor]


class ReleaseError(RuntimeError):
    """A release request that cannot proceed (the message says why)."""


class ReleaseConflictError(ReleaseError):
    """The request contradicts the release history (e.g. rolling back a non-head version)."""


@dataclass
class ReleaseContext:
    """What the pipeline touches: settings, the SQL engine, a producer on `releases`."""

    settings: Settings
    db: DbEngine
    producer: EventProducer

    @property
    def store_url(self) -> str:
        return self.settings.resolved_artifact_store_url

    @property
    def store(self) -> ArtifactStore:
        return build_artifact_store(artifact_store_config(self.store_url))

    def write(self, encoded: Any) -> str:
        """Store an encoded release; returns its manifest URI."""
        key = self.store.write_release(encoded.manifest, encoded.shards)
        return f"{self.store_url.rstrip('/')}/{key}"


def load_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def load_candidate(path: Path, base_model_dir: Path) -> Weights:
    """A trainer checkpoint as a full state dict (tied weights included, as the engine has).

    `path` is a Hugging Face model dir or a safetensors state dict; names, shapes and dtypes
    must match the base model's.
    """
    if not path.exists():
        raise ReleaseError(f"candidate checkpoint {path} does not exist")
    if path.is_dir():
        return {n: t.detach().clone() for n, t in load_model(path).state_dict().items()}
    from safetensors.torch import load_file

    model = load_model(base_model_dir)
    expected = {n: (t.shape, t.dtype) for n, t in model.state_dict().items()}
    loaded = load_file(str(path))
    odd = [n for n, t in loaded.items() if expected.get(n) != (t.shape, t.dtype)]
    if odd:
        raise ReleaseError(f"candidate {path} does not match the model: {odd[:5]}")
    missing, _ = model.load_state_dict(loaded, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    if set(missing) - tied - {"lm_head.weight"}:
        raise ReleaseError(f"candidate {path} lacks tensors: {sorted(missing)[:5]}")
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def save_weights(weights: Weights, path: Path) -> None:
    """Safetensors without shared storage (tied tensors are written as copies)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous().clone() for n, t in weights.items()}, str(path))


# ---- history -----------------------------------------------------------------------------
def head(session: Session) -> Release | None:
    """The served version: the newest published release."""
    return session.exec(select(Release).where(Release.status == "published")
                        .order_by(col(Release.version).desc())).first()


def next_version(session: Session) -> int:
    newest = session.exec(select(Release).order_by(col(Release.version).desc())).first()
    return 0 if newest is None else newest.version + 1


def reserve_version(db: DbEngine, *, requested_by: str, reason: str,
                    candidate_uri: str | None) -> int:
    """Record a candidate row now (so an API caller learns its version before the build)."""
    with Session(db) as session:
        version = max(next_version(session), 1)
        session.add(Release(version=version, kind="delta", sha256="", status="candidate",
                            requested_by=requested_by, reason=reason,
                            candidate_uri=candidate_uri))
        session.commit()
        return version


def chain_weights(ctx: ReleaseContext, release: Release) -> Weights:
    """The weights of `release`, from the head cache or rebuilt from the store."""
    cache = ctx.settings.data_dir / "releases" / "head.safetensors"
    if cache.exists():
        from safetensors.torch import load_file

        weights = load_file(str(cache))
        if state_dict_sha256(weights) == release.sha256:
            return weights
    store = ctx.store
    weights = {n: t.detach().clone()  # any weights of the layout: a snapshot overwrites them
               for n, t in load_model(ctx.settings.resolved_model_dir).state_dict().items()}
    steps = plan_chain(None, release.version, store.releases())
    apply_chain(weights, steps, lambda info: (store.read_manifest(info.version, info.kind),
                                              store.shard_reader(info.version, info.kind)))
    if state_dict_sha256(weights) != release.sha256:
        raise ReleaseError(f"v{release.version}: the store rebuilds other weights")
    save_weights(weights, cache)
    return weights


def ensure_base(ctx: ReleaseContext) -> Release:
    """The head, creating version 0 (the base model as a snapshot) on first use."""
    with Session(ctx.db) as session:
        current = head(session)
        if current is not None:
            return current
    weights = {n: t.detach().clone()
               for n, t in load_model(ctx.settings.resolved_model_dir).state_dict().items()}
    sha = state_dict_sha256(weights)
    uri = ctx.write(encode_snapshot(weights, version=0, sha256=sha))
    base = Release(version=0, kind="snapshot", status="published",
                   sha256=sha, snapshot_uri=uri, manifest_uri=uri,
                   requested_by="system", reason="base model", published_at=utcnow())
    _publish(ctx, base)
    with Session(ctx.db) as session:
        session.add(base)
        session.commit()
        session.refresh(base)
    save_weights(weights, ctx.settings.data_dir / "releases" / "head.safetensors")
    return base


def _publish(ctx: ReleaseContext, release: Release, *, kind: str | None = None,
             parent: int | None = None) -> ReleasePublished:
    event = ReleasePublished(
        version=release.version, parent=parent if parent is not None else release.parent,
        kind=kind or release.kind,  # type: ignore[arg-type]
        manifest_uri=release.manifest_uri or release.snapshot_uri or "",
        snapshot_uri=release.snapshot_uri, sha256=release.sha256,
        eval_summary={k: float(v) for k, v in release.eval_summary.items()
                      if isinstance(v, int | float)})
    topic = ctx.settings.topics.releases
    ctx.producer.send(topic, str(release.version), event).get(
        timeout=ctx.settings.kafka.delivery_timeout_ms / 1000)
    return event


# ---- pipeline ----------------------------------------------------------------------------
def build_release(ctx: ReleaseContext, *, candidate: Path | None = None,
                  version: int | None = None, requested_by: str = "system",
                  reason: str = "", provenance: dict[str, Any] | None = None) -> Release:
    """Gate, store, publish one candidate; returns its row (published or rejected)."""
    served = ensure_base(ctx)
    path = candidate or ctx.settings.resolved_candidate_path
    if version is None:
        version = reserve_version(ctx.db, requested_by=requested_by, reason=reason,
                                  candidate_uri=str(path))
    try:
        return _build(ctx, served, path, version, provenance or {})
    except Exception as exc:
        _finish(ctx, version, status="rejected", reason=f"build failed: {exc}")
        raise


def _build(ctx: ReleaseContext, served: Release, path: Path, version: int,
           provenance: dict[str, Any]) -> Release:
    base_weights = chain_weights(ctx, served)
    weights = load_candidate(path, ctx.settings.resolved_model_dir)
    sha = state_dict_sha256(weights)
    decision = evaluate(ctx.settings, base_weights, weights)
    if not decision.passed:
        return _finish(ctx, version, status="rejected", sha256=sha, reason=decision.reason,
                       eval_summary=decision.summary(), parent=served.version)
    chain = served.chain_length + 1
    snapshot_uri = None
    if chain >= ctx.settings.release.snapshot_every:
        snapshot_uri, chain = ctx.write(encode_snapshot(weights, version=version, sha256=sha)), 0
    manifest = ctx.write(encode_delta(base_weights, weights, base_version=served.version,
                                      target_version=version, base_sha256=served.sha256,
                                      target_sha256=sha))
    with Session(ctx.db) as session:
        row = session.get(Release, version)
        assert row is not None
        row.sqlmodel_update({
            "parent": served.version, "sha256": sha, "manifest_uri": manifest,
            "snapshot_uri": snapshot_uri, "kind": "snapshot" if snapshot_uri else "delta",
            "chain_length": chain, "eval_summary": decision.summary(),
            "step_range": provenance.get("step_range"),
            "generation_ids": provenance.get("generation_ids", []),
            "feedback_event_ids": provenance.get("feedback_event_ids", [])})
        _publish(ctx, row)
        row.status, row.published_at = "published", utcnow()
        session.add(row)
        session.commit()
        session.refresh(row)
    save_weights(weights, ctx.settings.data_dir / "releases" / "head.safetensors")
    log.info("published v%d (parent v%d, %s)", version, served.version, decision.reason)
    return row


def evaluate(settings: Settings, served: Weights, candidate: Weights) -> Any:
    """Score both with the configured suite on the base model architecture; `GateDecision`."""
    from transformers import AutoTokenizer

    model = load_model(settings.resolved_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(settings.resolved_model_dir)
    suite = build_eval_suite(settings.release.eval)
    model.load_state_dict(served)
    served_metrics = suite.evaluate(model, tokenizer)
    model.load_state_dict(candidate)
    candidate_metrics = suite.evaluate(model, tokenizer)
    return gate(candidate_metrics, served_metrics,
                max_regression=settings.release.eval.max_regression)


def _finish(ctx: ReleaseContext, version: int, *, status: str, reason: str,
            **fields: Any) -> Release:
    with Session(ctx.db) as session:
        row = session.get(Release, version)
        if row is None:
            raise ReleaseError(f"no release v{version}")
        row.sqlmodel_update({"status": status, "reason": reason, **fields})
        session.add(row)
        session.commit()
        session.refresh(row)
        log.warning("v%d %s: %s", version, status, reason)
        return row


def rollback_release(ctx: ReleaseContext, version: int, *, requested_by: str = "admin",
                     reason: str = "") -> Release:
    """Take the head `version` back to its parent; returns the parent (the new head)."""
    with Session(ctx.db) as session:
        row = session.get(Release, version)
        current = head(session)
        if row is None:
            raise ReleaseError(f"no release v{version}")
        if current is None or current.version != version:
            raise ReleaseConflictError(
                f"v{version} is {row.status}, not the served head "
                f"(v{current.version if current else '-'}); only the head can be rolled back")
        parent = session.get(Release, row.parent) if row.parent is not None else None
        if parent is None or parent.status != "published":
            raise ReleaseConflictError(f"v{version} has no published parent to return to")
        event = ReleasePublished(version=parent.version, parent=version, kind="rollback",
                                 manifest_uri=row.manifest_uri or "",
                                 snapshot_uri=parent.snapshot_uri, sha256=parent.sha256,
                                 eval_summary={})
        ctx.producer.send(ctx.settings.topics.releases, str(parent.version), event).get(
            timeout=ctx.settings.kafka.delivery_timeout_ms / 1000)
        row.sqlmodel_update({"status": "rolled_back", "rolled_back_at": utcnow(),
                             "rolled_back_by": requested_by, "rollback_reason": reason})
        session.add(row)
        session.commit()
        session.refresh(parent)
        return parent
