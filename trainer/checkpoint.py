"""Crash-safe checkpoints of the online trainer: weights, optimizer, offsets, ledger, together.

A checkpoint is one directory written whole before anything points at it:

    <root>/ckpt-00000042/tensors/    weights and optimizer state, torch.distributed.checkpoint
    <root>/ckpt-00000042/{state.json, ledger.jsonl, references.json}
    <root>/LATEST                    -> "ckpt-00000042"
    <root>/refs/<sha256>.pt          weights by sha256: the KL reference, the served release's

A checkpoint names the `refs/` it needs (`references.json`: what a resume from it loads);
once the checkpoints that named a ref are collected, so is the ref (a stashed candidate
that was refused, a release long replaced).

The tensors are a torch.distributed.checkpoint (DCP) directory: every rank of a sharded
trainer writes its own shards (one file per rank) and the leader the metadata, so no rank
gathers the model to save it, and DCP reshards on load: a checkpoint written at one world
size resumes at another. One process writes the same format. `save` writes into
`<root>/.tmp-…`, fsyncs every file and the directory, renames it to its final name (the
leader, after every rank's shards are durable), then replaces `LATEST` (write, fsync, rename,
fsync the root). The rename of
`LATEST` is the commit point: a kill before it leaves the previous checkpoint in force, a kill
after it leaves the new one; nothing in between is ever read. Kafka offsets are committed only
after `save` returns, and the checkpoint holds the offsets, so on restart the consumer seeks
to them and the ledger (every experience and feedback event id trained, by step) skips any
experience that was trained already (by experience id: a session verdict's experiences share
its feedback event id, one per turn).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from trainer.distributed import World

POINTER = "LATEST"
REFERENCES = "references.json"  # in a checkpoint: the refs/ a resume from it loads


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read back (the message names the file)."""


@dataclass(frozen=True)
class LedgerEntry:
    """What one optimizer step trained, in batch order."""

    step: int
    experience_ids: list[str]
    generation_ids: list[str]
    feedback_event_ids: list[str]


@dataclass
class Ledger:
    """Every experience trained so far, by step; answers "was this trained already?".

    Dedupes by experience id alone: the join keys every experience it makes by a stable id
    (`ingest.events.experience_id_for`), so a re-produced copy carries the same one, while a
    session verdict's experiences (one per turn) share their feedback event id. The event ids
    stay recorded per step, for provenance."""

    entries: list[LedgerEntry] = field(default_factory=list)
    _seen: set[str] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        for entry in self.entries:
            self._seen.update(entry.experience_ids)

    def contains(self, experience_id: str) -> bool:
        return experience_id in self._seen

    def record(self, entry: LedgerEntry) -> None:
        self.entries.append(entry)
        self._seen.update(entry.experience_ids)

    def between(self, first_step: int, last_step: int) -> list[LedgerEntry]:
        return [e for e in self.entries if first_step <= e.step <= last_step]

    @property
    def trained(self) -> int:
        return sum(len(e.experience_ids) for e in self.entries)

    def dumps(self) -> str:
        return "".join(json.dumps(asdict(e)) + "\n" for e in self.entries)

    @classmethod
    def loads(cls, text: str) -> Ledger:
        return cls([LedgerEntry(**json.loads(line)) for line in text.splitlines() if line])


@dataclass
class Checkpoint:
    """What `CheckpointStore.load` returns: the state and ledger, and where the tensors are
    (`CheckpointStore.load_tensors` reads them into a state dict of the caller's layout)."""

    name: str
    path: Path
    state: dict[str, Any]
    ledger: Ledger


@contextmanager
def _one_process_quietly() -> Iterator[None]:
    """DCP warns on every call without a process group that it assumes one process: it is
    what we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _torch_save_durable(obj: Any, path: Path) -> None:  # the reference weights
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


class CheckpointStore:
    """Atomic checkpoints under one root directory (module docstring)."""

    def __init__(self, root: Path, *, keep: int = 2) -> None:
        self.root = root
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "refs").mkdir(exist_ok=True)

    def latest_name(self) -> str | None:
        pointer = self.root / POINTER
        if not pointer.exists():
            return None
        return pointer.read_text().strip() or None

    def save(self, *, sequence: int, tensors: Mapping[str, Any], state: Mapping[str, Any],
             ledger: Ledger, world: World | None = None,
             references: Collection[str] = ()) -> str:
        """Write checkpoint number `sequence` and make it the latest; returns its name.

        Every rank calls it with its own shards in `tensors` (a state dict: tensors, DTensors,
        nested dicts); the leader's `state` and `ledger` are the ones written, with the
        sha256s of the `refs/` a resume from it needs (`references`)."""
        world = world or World()
        name = f"ckpt-{sequence:08d}"
        tmp = self.root / f".tmp-{name}"
        if world.leader:
            shutil.rmtree(tmp, ignore_errors=True)  # a kill's leftover of this very number
            tmp.mkdir()
        world.barrier()
        with _one_process_quietly():
            dcp.save(dict(tensors), no_dist=not world.sharded,
                     storage_writer=dcp.FileSystemWriter(tmp / "tensors", sync_files=True))
        if world.leader:  # DCP returns on the leader once every rank's shards are written
            _write_durable(tmp / "state.json", json.dumps(state, sort_keys=True).encode())
            _write_durable(tmp / "ledger.jsonl", ledger.dumps().encode())
            _write_durable(tmp / REFERENCES, json.dumps(sorted(references)).encode())
            _fsync_path(tmp / "tensors")
            _fsync_path(tmp)
            final = self.root / name
            if final.exists():  # left by a kill between its rename and the pointer: not live
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_path(self.root)
            self._point_to(name)
            self._collect_garbage(keep_name=name)
        world.barrier()
        return name

    def _point_to(self, name: str) -> None:
        tmp = self.root / f".{POINTER}.tmp"
        _write_durable(tmp, name.encode())
        os.replace(tmp, self.root / POINTER)
        _fsync_path(self.root)  # the commit point

    def _collect_garbage(self, *, keep_name: str) -> None:
        ckpts = sorted(p.name for p in self.root.glob("ckpt-*"))
        keep = set(ckpts[-self.keep:]) | {keep_name}
        for stale in [c for c in ckpts if c not in keep]:
            shutil.rmtree(self.root / stale, ignore_errors=True)
        for tmp in self.root.glob(".tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)
        self._collect_references(sorted(keep))

    def _collect_references(self, kept: list[str]) -> None:
        """Remove the refs no kept checkpoint names (none when one predates the list)."""
        named: set[str] = set()
        for name in kept:
            listed = self.root / name / REFERENCES
            if not listed.exists():
                return
            named.update(json.loads(listed.read_text()))
        for ref in (self.root / "refs").glob("*.pt"):
            if ref.stem not in named:
                ref.unlink(missing_ok=True)

    def load(self) -> Checkpoint | None:
        """The latest durable checkpoint, or None when there is none yet."""
        name = self.latest_name()
        if name is None:
            return None
        path = self.root / name
        try:
            state = json.loads((path / "state.json").read_text())
            ledger = Ledger.loads((path / "ledger.jsonl").read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: {exc}") from exc
        return Checkpoint(name=name, path=path, state=state, ledger=ledger)

    @staticmethod
    def load_tensors(ckpt: Checkpoint, into: dict[str, Any]) -> None:
        """Fill the state dict `into` in place (its keys, shapes and sharding say what to read:
        this rank's shards, at any world size)."""
        try:
            with _one_process_quietly():
                dcp.load(into, storage_reader=dcp.FileSystemReader(ckpt.path / "tensors"),
                         no_dist=not torch.distributed.is_initialized())
        except (OSError, ValueError, RuntimeError, dcp.CheckpointException) as exc:
            raise CheckpointError(f"{ckpt.path / 'tensors'}: {exc}") from exc

    # The KL reference (the served release's weights): written once per release, by sha256.
    def save_reference(self, sha256: str, weights: Mapping[str, torch.Tensor]) -> Path:
        path = self.root / "refs" / f"{sha256}.pt"
        if not path.exists():
            tmp = path.with_suffix(f".tmp-{uuid.uuid4().hex[:8]}")
            _torch_save_durable(dict(weights), tmp)
            os.rename(tmp, path)
            _fsync_path(path.parent)
        return path

    def load_reference(self, sha256: str) -> dict[str, torch.Tensor]:
        path = self.root / "refs" / f"{sha256}.pt"
        if not path.exists():
            raise CheckpointError(f"reference weights {path} are missing")
        return torch.load(path, weights_only=True)
