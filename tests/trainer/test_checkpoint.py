"""Checkpoints: bitwise round trip, the pointer as the only commit point, the ledger."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainer.checkpoint import POINTER, Checkpoint, CheckpointStore, Ledger, LedgerEntry


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(16, 4, generator=g)
    return {"embed.weight": emb, "lm_head.weight": emb, "bias": torch.randn(3, generator=g)}


def _read(ckpt: Checkpoint, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's "weights", read into tensors shaped like `like`."""
    into = {"weights": {name: torch.zeros_like(t) for name, t in like.items()}}
    CheckpointStore.load_tensors(ckpt, into)
    return into["weights"]


def _entry(step: int, *ids: str) -> LedgerEntry:
    return LedgerEntry(step=step, experience_ids=[f"exp-{i}" for i in ids],
                       generation_ids=[f"gen-{i}" for i in ids],
                       feedback_event_ids=[f"evt-{i}" for i in ids])


def test_round_trip_is_bitwise(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    assert store.load() is None
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    ledger = Ledger([_entry(0, "a", "b")])
    weights, optimizer = get_state_dict(model, opt)
    store.save(sequence=1, tensors={"weights": weights, "optimizer": optimizer},
               state={"step": 1, "offsets": {"experiences:0": 2}}, ledger=ledger)
    ckpt = store.load()
    assert ckpt is not None and ckpt.name == "ckpt-00000001"
    fresh = torch.nn.Linear(4, 2)
    restored = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    into = dict(zip(("weights", "optimizer"), get_state_dict(fresh, restored), strict=True))
    store.load_tensors(ckpt, into)
    set_state_dict(fresh, restored, model_state_dict=into["weights"],
                   optim_state_dict=into["optimizer"])
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor)
    assert torch.equal(restored.state_dict()["state"][0]["exp_avg"],
                       opt.state_dict()["state"][0]["exp_avg"])
    assert ckpt.state["offsets"] == {"experiences:0": 2}
    assert ckpt.ledger.contains("exp-a") and ckpt.ledger.contains("exp-b")
    assert not ckpt.ledger.contains("exp-c")
    assert ckpt.ledger.entries[0].feedback_event_ids == ["evt-a", "evt-b"]


def test_only_the_pointer_commits(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    store.save(sequence=1, tensors={"weights": _weights(1)}, state={"step": 1}, ledger=Ledger())
    # A kill after a checkpoint's rename but before the pointer moved leaves an orphan dir,
    # and a kill mid-write leaves a temp dir: neither is ever read, both are replaced later.
    (tmp_path / "ckpt-00000002").mkdir()
    (tmp_path / "ckpt-00000002" / "weights.pt").write_bytes(b"torn")
    (tmp_path / ".tmp-ckpt-00000003-dead").mkdir()
    ckpt = store.load()
    assert ckpt is not None and ckpt.state == {"step": 1}
    store.save(sequence=2, tensors={"weights": _weights(2)}, state={"step": 2}, ledger=Ledger())
    ckpt = store.load()
    assert ckpt is not None and ckpt.state == {"step": 2}
    assert torch.equal(_read(ckpt, _weights(2))["bias"], _weights(2)["bias"])
    assert not list(tmp_path.glob(".tmp-*"))


def test_old_checkpoints_are_collected(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for seq in range(1, 6):
        store.save(sequence=seq, tensors={"weights": _weights(seq)}, state={}, ledger=Ledger())
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-00000004",
                                                              "ckpt-00000005"]
    assert (tmp_path / POINTER).read_text() == "ckpt-00000005"


def test_a_ref_goes_with_the_last_checkpoint_that_names_it(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for sha in ("a", "b", "c"):
        store.save_reference(sha, _weights(0))
    store.save(sequence=1, tensors={"weights": _weights(1)}, state={}, ledger=Ledger(),
               references={"a", "b"})
    assert sorted(p.stem for p in (tmp_path / "refs").glob("*.pt")) == ["a", "b"]  # c: none
    store.save(sequence=2, tensors={"weights": _weights(2)}, state={}, ledger=Ledger(),
               references={"b"})
    assert sorted(p.stem for p in (tmp_path / "refs").glob("*.pt")) == ["a", "b"]  # kept: 1
    store.save(sequence=3, tensors={"weights": _weights(3)}, state={}, ledger=Ledger(),
               references={"b"})
    assert sorted(p.stem for p in (tmp_path / "refs").glob("*.pt")) == ["b"]
    assert store.load_reference("b").keys() == _weights(0).keys()


def test_kill_during_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(sequence=1, tensors={"weights": _weights(1)}, state={"step": 1}, ledger=Ledger())
    big = {f"w{i}": torch.randn(256, 256) for i in range(64)}  # slow enough to be caught
    for delay_ms in (0, 5, 20):
        pid = os.fork()
        if pid == 0:  # the child saves and is killed by the parent at some point
            try:
                CheckpointStore(tmp_path).save(sequence=2, tensors={"weights": big},
                                               state={"step": 2}, ledger=Ledger())
            finally:
                os._exit(0)
        if delay_ms:
            time.sleep(delay_ms / 1000)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        ckpt = CheckpointStore(tmp_path).load()
        assert ckpt is not None and ckpt.state["step"] in (1, 2)
        if ckpt.state["step"] == 2:
            assert torch.equal(_read(ckpt, big)["w63"], big["w63"])


def test_ledger_between_and_counts() -> None:
    ledger = Ledger()
    ledger.record(_entry(0, "a", "b"))
    ledger.record(_entry(1, "c"))
    ledger.record(_entry(2, "d"))
    assert [e.step for e in ledger.between(1, 2)] == [1, 2]
    assert ledger.trained == 4
    assert Ledger.loads(ledger.dumps()).entries == ledger.entries


def test_ledger_dedupes_by_experience_id_only() -> None:
    """A session verdict yields one experience per turn, all with its one feedback event id:
    training the first turns must not make the ledger skip the others."""
    ledger = Ledger()
    ledger.record(LedgerEntry(step=0, experience_ids=["exp-turn0", "exp-turn1"],
                              generation_ids=["gen-0", "gen-1"],
                              feedback_event_ids=["evt-verdict", "evt-verdict"]))
    for restored in (ledger, Ledger.loads(ledger.dumps())):
        assert restored.contains("exp-turn0") and restored.contains("exp-turn1")
        assert not restored.contains("exp-turn2")  # the same verdict's last turn, untrained
        assert restored.entries[0].feedback_event_ids == ["evt-verdict", "evt-verdict"]
