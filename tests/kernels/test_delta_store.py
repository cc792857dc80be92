"""The artifact store on a temp directory and on fsspec memory://: bytes, listing, releases."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from kernels.delta import DeltaOptions, apply_delta, encode_delta, encode_snapshot
from kernels.delta.chain import apply_chain, plan_chain
from kernels.delta.store import (
    ArtifactNotFoundError,
    ArtifactStore,
    FsspecStoreConfig,
    LocalArtifactStore,
    LocalStoreConfig,
    artifact_store_adapter,
    artifact_store_config,
    build_artifact_store,
)


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ArtifactStore]:
    if request.param == "local":
        yield build_artifact_store(artifact_store_config(f"file://{tmp_path}/store"))
    else:
        url = f"memory://flywheel-test-{uuid.uuid4().hex}"
        built = build_artifact_store(artifact_store_config(url))
        yield built
        built.fs.rm(built.root, recursive=True)  # type: ignore[attr-defined]


def test_bytes_round_trip_and_listing(store: ArtifactStore) -> None:
    store.put_bytes("a/b/one.bin", b"1")
    store.put_bytes("a/two.bin", b"22")
    store.put_bytes("a/two.bin", b"second")
    assert store.get_bytes("a/two.bin") == b"second"
    assert store.exists("a/b/one.bin") and not store.exists("a/none.bin")
    assert store.list("a") == ["a/b/one.bin", "a/two.bin"]
    assert store.list("nothing") == []
    with pytest.raises(ArtifactNotFoundError):
        store.get_bytes("a/none.bin")


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": (torch.randn(4000, generator=gen) * 0.02).to(torch.bfloat16),
            "b": torch.randn(10, generator=gen)}


def test_release_written_then_applied_from_the_store(store: ArtifactStore) -> None:
    v0, v1 = _weights(0), _weights(0)
    v1["w"] = (v1["w"].float() + 1e-4).to(torch.bfloat16)
    delta = encode_delta(v0, v1, base_version=0, target_version=1,
                         options=DeltaOptions(shard_bytes=300))
    key = store.write_release(delta.manifest, delta.shards)
    store.write_release(*_snapshot(v0))
    assert key == "releases/1/delta/manifest.json" and store.exists(key)
    assert len(store.list("releases/1/delta")) == len(delta.shards) + 1
    assert store.read_manifest(1) == delta.manifest
    infos = store.releases()
    assert sorted((r.version, r.kind) for r in infos) == [(0, "snapshot"), (1, "delta")]
    live = {k: torch.zeros_like(v) for k, v in v0.items()}
    steps = plan_chain(None, 1, infos)
    reached = apply_chain(live, steps, lambda r: (store.read_manifest(r.version, r.kind),
                                                  store.shard_reader(r.version, r.kind)))
    assert reached is not None and reached.version == 1
    assert all(torch.equal(live[k].view(torch.uint8), v1[k].view(torch.uint8)) for k in v1)
    assert apply_delta(live, store.read_manifest(1), store.shard_reader(1)).version == 0


def _snapshot(weights: dict[str, torch.Tensor]):
    release = encode_snapshot(weights, version=0)
    return release.manifest, release.shards


def test_local_release_is_renamed_into_place(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path)
    store.write_release(*_snapshot(_weights(1)))
    store.write_release(*_snapshot(_weights(2)))  # rewriting a version replaces it whole
    names = sorted(p.name for p in (tmp_path / "releases" / "0").iterdir())
    assert names == ["snapshot"]
    assert not [p for p in tmp_path.rglob(".tmp-*")]
    with pytest.raises(ValueError):
        store.put_bytes("../escape.bin", b"x")


def test_config_is_a_discriminated_union(tmp_path: Path) -> None:
    assert artifact_store_config(str(tmp_path)) == LocalStoreConfig(root=tmp_path)
    assert isinstance(artifact_store_config("s3://bucket/prefix"), FsspecStoreConfig)
    parsed = artifact_store_adapter.validate_python({"kind": "fsspec", "url": "memory://x"})
    assert isinstance(parsed, FsspecStoreConfig)
    with pytest.raises(ValidationError):
        artifact_store_adapter.validate_python({"kind": "ftp", "url": "x"})


def test_a_relative_root_lists_and_reads_like_an_absolute_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default data dir is relative (`data`): the root is made absolute once, so the
    listing (resolved paths made relative to the root) works, and a child process given
    the config reads the same directory wherever it starts."""
    monkeypatch.chdir(tmp_path)
    store = build_artifact_store(artifact_store_config("data/policy"))
    assert store.config == LocalStoreConfig(root=tmp_path.resolve() / "data" / "policy")
    store.put_bytes("releases/0/snapshot/manifest.json", b"{}")
    assert store.list("releases/") == ["releases/0/snapshot/manifest.json"]
    assert LocalArtifactStore(Path("data/policy")).get_bytes(
        "releases/0/snapshot/manifest.json") == b"{}"
