"""Releases end to end under load: the real broker, SQLite, the app's embedded Celery worker
on the filesystem broker, the tiny model served by the stack while 16 clients keep calling it.

Five releases through `POST /admin/releases`, then a rollback: zero failed requests, every
response names a version the replica had published, and after each release the replica's
live weights hash to the trainer's checkpoint. Then a delta with one flipped byte is
announced: the replica refuses it and keeps serving.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from app.cli.stack import running_stack
from app.settings import Settings
from ingest.events import ReleasePublished
from ingest.log import EventProducer
from kernels.delta import encode_delta
from kernels.delta.store import artifact_store_config, build_artifact_store
from kernels.weights import state_dict_sha256
from serving.engine import ModelVersion
from tests.integration.helpers import Load, release_candidate, replica_status, swapped_to, wait_for
from tests.trainer.helpers import make_checkpoint
from trainer.release.config import HeldOutLossEval
from trainer.release.weights import load_model

pytestmark = pytest.mark.integration


def test_five_releases_and_a_rollback_under_load(settings: Settings, tmp_path: Path,
                                                 model_dir: Path) -> None:
    settings = settings.model_copy(update={"release": settings.release.model_copy(update={
        "snapshot_every": 3, "eval": HeldOutLossEval(sequences=2, seq_len=64)})})
    admin = {"Authorization": f"Bearer {settings.admin_secret().get_secret_value()}"}
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
