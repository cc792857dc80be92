"""Policy versions out to the rollout fleet, as deltas.

`PolicyPublisher` puts each new policy version in the policy store as a delta against the one
before (a full snapshot first, and every `snapshot_every` versions, for workers that join late
or fall far behind), prunes what no worker needs any more, and announces it on the `policy`
topic as a `ReleasePublished`. Encoding runs on its own thread; when versions come faster than
it encodes, it skips to the newest (the delta spans the gap). Deltas group a float tensor's
changes by exponent (`exponent_nibble`, kernels/delta/exponent.py): a version ships every step
to every worker, on any host and link, and the bootstrap's model is small, so bytes count more
than the milliseconds a worker spends applying them.
"""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ingest.config import KafkaConfig
from ingest.events import ReleaseKind, ReleasePublished
from ingest.log import EventProducer
from kernels.delta import DeltaOptions, encode_delta, encode_snapshot
from kernels.delta.store import ArtifactStore, release_prefix
from kernels.weights import state_dict_sha256
from simulate.rollout_worker import MODEL_PREFIX

log = logging.getLogger(__name__)

POLICY_DELTA_OPTIONS = DeltaOptions(group_by_exponent=True)

Weights = dict[str, torch.Tensor]


class FleetError(RuntimeError):
    """The fleet cannot go on (no worker delivered for too long, the publisher failed)."""


@dataclass
class Shipped:
    version: int
    kind: str  # delta | snapshot
    nbytes: int  # stored (compressed) bytes of the release


class PolicyPublisher:
    def __init__(self, store: ArtifactStore, kafka: KafkaConfig, *,
                 snapshot_every: int = 20) -> None:
        self.store, self.kafka = store, kafka
        self.snapshot_every = snapshot_every
        self.shipped: list[Shipped] = []
        self.full_bytes = 0  # the raw weights of one version
        self._producer = EventProducer(kafka, client_id="policy-publisher")
        self._cond = threading.Condition()
        self._pending: tuple[int, Weights] | None = None
        self._announced = -1
        self._base: tuple[int, str, Weights] | None = None  # last announced: version, sha, w
        self._snapshot = -1  # the newest version stored as a snapshot (-1: none yet)
        self._deltas: list[int] = []  # versions stored as deltas, after that snapshot
        self._error: BaseException | None = None
        self._closed = False
        # called on the publisher's thread with each version right after it is announced
        self.on_announced: list[Callable[[int], None]] = []
        self._thread = threading.Thread(target=self._run, name="policy-publisher", daemon=True)

    @property
    def announced(self) -> int:
        """The newest version announced (-1: none yet)."""
        return self._announced

    def start(self, version: int, weights: Weights, model_files: dict[str, bytes]
              ) -> PolicyPublisher:
        """Store the model's files and `version` as a snapshot, announce it; then publish on
        the publisher's thread."""
        for name, data in model_files.items():
            self.store.put_bytes(MODEL_PREFIX + name, data)
        self.full_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        self._ship(version, weights)
        self._thread.start()
        return self

    def publish(self, version: int, weights: Weights) -> None:
        """Queue `version` (`weights` must not change afterwards); returns at once."""
        with self._cond:
            if self._error is not None:
                raise FleetError("the policy publisher failed") from self._error
            self._pending = (version, weights)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
        self._producer.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                version, weights = self._pending
                self._pending = None
            try:
                self._ship(version, weights)
            except BaseException as exc:  # surfaced to the trainer by the next publish
                log.exception("policy v%d could not be published", version)
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return

    def _ship(self, version: int, weights: Weights) -> None:
        sha = state_dict_sha256(weights)
        parent = None if self._base is None else self._base[0]
        if parent is None or version - self._snapshot >= self.snapshot_every:
            encoded = encode_snapshot(weights, version=version, sha256=sha)
            self.store.write_release(encoded.manifest, encoded.shards)
            self.shipped.append(Shipped(version, "snapshot", encoded.manifest.nbytes))
            self._prune(version)
        if self._base is not None:
            base_version, base_sha, base = self._base
            encoded = encode_delta(base, weights, base_version=base_version,
                                   target_version=version, base_sha256=base_sha,
                                   target_sha256=sha, options=POLICY_DELTA_OPTIONS)
            self.store.write_release(encoded.manifest, encoded.shards)
            self.shipped.append(Shipped(version, "delta", encoded.manifest.nbytes))
            self._deltas.append(version)
        kind: ReleaseKind = "snapshot" if parent is None else "delta"
        uri = release_prefix(version, kind)
        event = ReleasePublished(version=version, parent=parent, kind=kind, manifest_uri=uri,
                                 snapshot_uri=uri if parent is None else None, sha256=sha)
        self._producer.send(self.kafka.topics.policy, str(version), event).get(
            timeout=self.kafka.delivery_timeout_ms / 1000)
        self._base = (version, sha, weights)
        with self._cond:
            self._announced = version
            self._cond.notify_all()
        for hook in self.on_announced:
            hook(version)

    def _prune(self, snapshot: int) -> None:
        """`snapshot` was just stored: drop the older snapshot and every delta, so the store
        keeps the newest snapshot and the deltas from it on (what takes a worker from any
        version since that snapshot, or from none, to the newest)."""
        if self._snapshot >= 0:
            self.store.delete_prefix(release_prefix(self._snapshot, "snapshot"))
        for old in self._deltas:
            self.store.delete_prefix(release_prefix(old, "delta"))
        self._snapshot, self._deltas = snapshot, []

    def delta_bytes(self) -> float:
        """Mean stored bytes of one version's delta."""
        deltas = [s.nbytes for s in self.shipped if s.kind == "delta"]
        return sum(deltas) / max(1, len(deltas))



def model_files(policy_model: Any, tokenizer: Any) -> dict[str, bytes]:
    """The model's config and tokenizer files (no weights): what a worker builds it from."""
    with tempfile.TemporaryDirectory() as tmp:
        policy_model.config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
