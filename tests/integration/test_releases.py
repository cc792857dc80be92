"""Releases end to end under load: the real broker, SQLite, the app's embedded Celery worker
on the filesystem broker, the tiny model served by the stack while 16 clients keep calling it.

Five releases through `POST /admin/releases`, then a rollback: zero failed requests, every
response names a version the replica had published, and after each release the replica's
live weights hash to the trainer's checkpoint. Then a delta with one flipped byte is
announced: the replica refuses it and keeps serving.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from app.cli.stack import running_stack
from app.settings import Settings
from ingest.events import ReleasePublished
from ingest.log import EventProducer
from kernels.delta import encode_delta
from kernels.delta.store import artifact_store_config, build_artifact_store
from kernels.weights import state_dict_sha256
from serving.engine import ModelVersion
from tests.trainer.release.test_pipeline import make_checkpoint
from trainer.release.config import HeldOutLossEval
from trainer.release.weights import load_model

pytestmark = pytest.mark.integration
CLIENTS = 16


class Load:
    """16 concurrent chat clients on their own event loop, recording every outcome."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.stop = threading.Event()
        self.fingerprints: list[str] = []
        self.failures: list[str] = []
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _client(self, http: httpx.AsyncClient, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                r = await http.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": f"def f{i}_{n}(x):"}],
                    "max_tokens": 4, "temperature": 0.8})
            except httpx.HTTPError as exc:
                self.failures.append(f"client {i}: {exc!r}")
                continue
            if r.status_code != 200:
                self.failures.append(f"client {i}: {r.status_code} {r.text[:200]}")
            else:
                self.fingerprints.append(r.json()["system_fingerprint"])

    async def _main(self) -> None:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=120) as http:
            await asyncio.gather(*(self._client(http, i) for i in range(CLIENTS)))


def wait_for(predicate, what: str, timeout_s: float = 60.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def replica_status(http: httpx.Client) -> dict:
    return http.get("/admin/status").json()["replica"]


def swapped_to(http: httpx.Client, version: int, timeout_s: float = 60.0) -> dict:
    """The replica's status once its last swap is to `version`."""
    return wait_for(lambda: (s := replica_status(http))["last_swap"] is not None
                    and s["last_swap"]["version"] == version and s, f"swap to v{version}",
                    timeout_s)


def release_candidate(http: httpx.Client, model_dir: Path, ckpt: Path, *, seed: int,
                      reason: str, scale: float = 1e-3,
                      base: dict[str, torch.Tensor] | None = None
                      ) -> tuple[int, dict[str, torch.Tensor]]:
    """A trainer checkpoint (`base` plus seeded noise) at `ckpt`, released through the admin
    API: (the version it will be, its weights)."""
    weights = make_checkpoint(model_dir, ckpt, scale=scale, seed=seed, base=base)
    r = http.post("/admin/releases", json={"candidate": str(ckpt), "reason": reason})
    assert r.status_code == 202, r.text
    return r.json()["version"], weights


def test_five_releases_and_a_rollback_under_load(settings: Settings, tmp_path: Path,
                                                 model_dir: Path) -> None:
    settings = settings.model_copy(update={"release": settings.release.model_copy(update={
        "snapshot_every": 3, "eval": HeldOutLossEval(sequences=2, seq_len=64)})})
    admin = {"Authorization": f"Bearer {settings.admin_token.get_secret_value()}"}
    with running_stack(settings) as stack, httpx.Client(base_url=stack.base_url,
                                                        timeout=60, headers=admin) as http:
        base = replica_status(http)
        published = {ModelVersion(base["version"], base["sha256"]).fingerprint}
        load = Load(stack.base_url)
        load.thread.start()
        weights = load_model(model_dir).state_dict()
        shas = {}
        for i in range(5):  # built by the Celery worker the app runs in the embedded profile
            ckpt = settings.data_dir / f"ckpt{i}.safetensors"  # releases come from under it
            version, weights = release_candidate(http, model_dir, ckpt, seed=i,
                                                 reason=f"test {i}", base=weights)
            shas[version] = state_dict_sha256(weights)
            status = swapped_to(http, version)
            assert status["last_swap"]["live_sha256"] == shas[version]
            published.add(ModelVersion(version, shas[version]).fingerprint)
            row = http.get(f"/admin/releases/{version}").json()
            assert (row["status"], row["sha256"]) == ("published", shas[version])
        assert [r["kind"] for r in http.get("/admin/releases").json()] == [
            "delta", "delta", "snapshot", "delta", "delta", "snapshot"]

        r = http.post(f"/admin/releases/{version}/rollback", json={"reason": "test"})
        assert r.status_code == 200, r.text
        back = r.json()["version"]
        status = swapped_to(http, back)
        assert status["last_swap"]["live_sha256"] == shas[back]
        assert http.get(f"/admin/releases/{version}").json()["status"] == "rolled_back"
        assert http.post(f"/admin/releases/{version}/rollback").status_code == 409

        # A delta with one flipped byte: refused, and the replica keeps serving v{back}.
        bad = make_checkpoint(model_dir, tmp_path / "bad.safetensors", scale=1e-3, seed=99,
                              base=weights)
        served = _weights_of(settings.data_dir, back)  # v{n} is checkpoint n-1
        root = stack.settings.resolved_artifact_store_url
        encoded = encode_delta(served, bad, base_version=back, target_version=900)
        key = build_artifact_store(artifact_store_config(root)).write_release(
            encoded.manifest, encoded.shards)
        uri = f"{root}/{key}"
        shard = Path(uri).parent / encoded.manifest.shards[0].name
        blob = bytearray(shard.read_bytes())
        blob[len(blob) // 3] ^= 0x01
        shard.write_bytes(bytes(blob))
        producer = EventProducer(stack.kafka)
        producer.send(stack.kafka.topics.releases, "900", ReleasePublished(
            version=900, parent=back, kind="delta", manifest_uri=uri,
            sha256=state_dict_sha256(bad))).get(timeout=30)
        producer.close()
        status = wait_for(lambda: (s := replica_status(http))["refused"] >= 1 and s, "refusal")
        assert "sha256" in status["last_refusal"]["error"], status["last_refusal"]
        time.sleep(2)  # requests keep flowing on the old version
        load.stop.set()
        load.thread.join(timeout=120)
        assert replica_status(http)["version"] == back

    assert load.failures == []
    assert len(load.fingerprints) > 50
    assert set(load.fingerprints) <= published
    print(f"\nresponses {len(load.fingerprints)}, versions seen {len(set(load.fingerprints))}, "
          f"max pause {status['max_pause_s'] * 1000:.1f} ms, commits (ms) "
          f"{[round(s['copy_s'] * 1000, 2) for s in [status['last_swap']]]}")


def _weights_of(data_dir: Path, version: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(data_dir / f"ckpt{version - 1}.safetensors"))
