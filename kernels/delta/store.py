"""The artifact store: where releases (a manifest and its shards) live.

A local directory by default, any fsspec URL in production (s3://, gs://, memory:// in tests).
Keys are '/'-separated paths under the store's root. A release of version v is written under
`releases/<v>/<kind>/` (kind: delta or snapshot) with its shards first and `manifest.json`
last; in a local directory the whole release is written to a temporary directory and renamed
into place, so a reader never sees half a release.

    store = build_artifact_store(artifact_store_config("file:///var/flywheel/artifacts"))
    store.write_release(encoded.manifest, encoded.shards)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, TypeAdapter

from kernels.delta.chain import ReleaseInfo
from kernels.delta.manifest import DeltaManifest
from kernels.delta.state_dict import ShardReader

MANIFEST = "manifest.json"
Keys = list[str]  # `list` is also a method name below
Releases = list[ReleaseInfo]


class ArtifactNotFoundError(KeyError):
    """A key (or release) that the store does not hold."""


class LocalStoreConfig(BaseModel):
    kind: Literal["local"] = "local"
    # absolute, symbolic links resolved: keys are paths relative to it, and a child process
    # given this config may start in another working directory
    root: Annotated[Path, AfterValidator(lambda p: p.expanduser().resolve())]


class FsspecStoreConfig(BaseModel):
    kind: Literal["fsspec"] = "fsspec"
    url: str = Field(pattern=r"^[a-z0-9+]+://")
    storage_options: dict[str, Any] = {}


ArtifactStoreConfig = Annotated[LocalStoreConfig | FsspecStoreConfig, Field(discriminator="kind")]


def artifact_store_config(url: str) -> LocalStoreConfig | FsspecStoreConfig:
    """A plain path or file:// URL is a local directory; any other URL goes through fsspec."""
    if "://" not in url or url.startswith("file://"):
        return LocalStoreConfig(root=Path(url.removeprefix("file://")))
    return FsspecStoreConfig(url=url)


def release_prefix(version: int, kind: str) -> str:
    return f"releases/{version}/{kind}"


class ArtifactStore(ABC):
    """Bytes by key, plus releases laid out as manifest + shards."""

    config: LocalStoreConfig | FsspecStoreConfig  # what `build_artifact_store` rebuilds it from

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def get_bytes(self, key: str) -> bytes: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str = "") -> Keys:
        """Every key under `prefix`, sorted."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Remove every key under `prefix` (a release: `release_prefix(version, kind)`)."""

    def write_release(self, manifest: DeltaManifest, shards: Mapping[str, bytes]) -> str:
        """Shards first, the manifest last: a visible manifest means a complete release."""
        prefix = release_prefix(manifest.target.version, manifest.kind)
        for name, data in shards.items():
            self.put_bytes(f"{prefix}/{name}", data)
        self.put_bytes(f"{prefix}/{MANIFEST}", manifest.model_dump_json(indent=1).encode())
        return f"{prefix}/{MANIFEST}"

    def read_manifest(self, version: int, kind: str = "delta") -> DeltaManifest:
        key = f"{release_prefix(version, kind)}/{MANIFEST}"
        return DeltaManifest.model_validate_json(self.get_bytes(key))

    def shard_reader(self, version: int, kind: str = "delta") -> ShardReader:
        prefix = release_prefix(version, kind)
        return lambda name: self.get_bytes(f"{prefix}/{name}")

    def releases(self) -> Releases:
        """Every complete release (one with a manifest), for `plan_chain`."""
        keys = [k for k in self.list("releases/") if k.endswith(f"/{MANIFEST}")]
        return [ReleaseInfo.of(DeltaManifest.model_validate_json(self.get_bytes(k)))
                for k in keys]


class LocalArtifactStore(ArtifactStore):
    """A directory; every write lands under a temporary name and is renamed into place."""

    def __init__(self, root: Path):
        self.config = LocalStoreConfig(root=root)
        self.root = self.config.root  # absolute: keys are paths relative to it
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root):
            raise ValueError(f"key {key!r} leaves the store")
        return path

    def put_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".tmp-", delete=False) as f:
            f.write(data)
        os.replace(f.name, path)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError as exc:
            raise ArtifactNotFoundError(key) from exc

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def list(self, prefix: str = "") -> Keys:
        base = self._path(prefix) if prefix.rstrip("/") else self.root
        if not base.is_dir():
            return []
        keys = (p.relative_to(self.root).as_posix() for p in base.rglob("*") if p.is_file())
        return sorted(k for k in keys if not Path(k).name.startswith(".tmp-"))

    def delete_prefix(self, prefix: str) -> None:
        path = self._path(prefix)
        if path == self.root:
            raise ValueError("refusing to delete the whole store")
        shutil.rmtree(path, ignore_errors=True)

    def write_release(self, manifest: DeltaManifest, shards: Mapping[str, bytes]) -> str:
        """Write into a temporary sibling directory, then rename it into place."""
        prefix = release_prefix(manifest.target.version, manifest.kind)
        final = self._path(prefix)
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=".tmp-"))
        try:
            for name, data in shards.items():
                (staging / name).write_bytes(data)
            (staging / MANIFEST).write_bytes(manifest.model_dump_json(indent=1).encode())
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return f"{prefix}/{MANIFEST}"


class FsspecArtifactStore(ArtifactStore):
    """Any fsspec filesystem; object stores make each put atomic on their own."""

    def __init__(self, url: str, storage_options: Mapping[str, Any]):
        import fsspec

        self.config = FsspecStoreConfig(url=url, storage_options=dict(storage_options))
        self.fs, self.root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = self.root.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.root}/{key.lstrip('/')}"

    def put_bytes(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(key), data)

    def get_bytes(self, key: str) -> bytes:
        try:
            return bytes(self.fs.cat_file(self._path(key)))
        except FileNotFoundError as exc:
            raise ArtifactNotFoundError(key) from exc

    def exists(self, key: str) -> bool:
        return bool(self.fs.exists(self._path(key)))

    def list(self, prefix: str = "") -> Keys:
        base = self._path(prefix)
        if not self.fs.exists(base):
            return []
        # `find` names paths as `url_to_fs` named the root: without the protocol
        return sorted(p[len(self.root) + 1:] for p in self.fs.find(base))

    def delete_prefix(self, prefix: str) -> None:
        if not prefix.strip("/"):
            raise ValueError("refusing to delete the whole store")
        base = self._path(prefix)
        if self.fs.exists(base):
            self.fs.rm(base, recursive=True)


def build_artifact_store(config: LocalStoreConfig | FsspecStoreConfig) -> ArtifactStore:
    """The one place that maps a store config to its implementation."""
    if isinstance(config, LocalStoreConfig):
        return LocalArtifactStore(config.root)
    return FsspecArtifactStore(config.url, config.storage_options)


artifact_store_adapter: TypeAdapter[LocalStoreConfig | FsspecStoreConfig] = TypeAdapter(
    ArtifactStoreConfig)
