"""Admission control and bounded staleness of the rollout/trainer pipeline."""

from __future__ import annotations

import threading
import time

import pytest

from trainer.pipeline import PipelineClosedError, Slot, StalenessGate, StaleRolloutError


def test_slots_map_to_steps() -> None:
    gate: StalenessGate[str] = StalenessGate(groups_per_step=2, max_staleness=1)
    assert [gate.claim() for _ in range(5)] == [Slot(0, 0), Slot(1, 0), Slot(2, 1), Slot(3, 1),
                                                Slot(4, 2)]


def test_batched_claims_never_span_two_steps() -> None:
    gate: StalenessGate[str] = StalenessGate(groups_per_step=3, max_staleness=0)
    assert gate.claim_batch(2) == [Slot(0, 0), Slot(1, 0)]
    assert gate.claim_batch(2) == [Slot(2, 0)]  # the rest of step 0 only: sync would deadlock
    assert gate.claim_batch(5) == [Slot(3, 1), Slot(4, 1), Slot(5, 1)]


def test_worker_waits_for_fresh_weights_and_is_released_by_publish() -> None:
    gate: StalenessGate[str] = StalenessGate(groups_per_step=1, max_staleness=1)
    assert gate.wait_for_weights(1) == 0  # step 1 may use version 0 (staleness 1)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(gate.wait_for_weights(3)))
    waiter.start()
    time.sleep(0.3)
    assert not got  # step 3 needs version >= 2
    gate.publish(1)
    time.sleep(0.3)
    assert not got
    gate.publish(2)
    waiter.join(timeout=5)
    assert got == [2]


def test_stale_group_is_refused_not_dropped() -> None:
    gate: StalenessGate[str] = StalenessGate(groups_per_step=1, max_staleness=1)
    with pytest.raises(StaleRolloutError, match="too stale for step 3"):
        gate.submit(Slot(3, 3), "g", policy_version=1)
    gate.submit(Slot(3, 3), "g", policy_version=2)
    assert gate.admitted == 1


def test_sync_mode_alternates_trainer_and_rollouts() -> None:
    """max_staleness=0: the group for step k is made only after the trainer published k."""
    gate: StalenessGate[int] = StalenessGate(groups_per_step=1, max_staleness=0)
    events: list[str] = []

    def worker() -> None:
        try:
            while True:
                slot = gate.claim()
                version = gate.wait_for_weights(slot.step)
                events.append(f"roll{slot.step}@v{version}")
                gate.submit(slot, version, policy_version=version)
        except PipelineClosedError:
            return

    thread = threading.Thread(target=worker)
    thread.start()
    for step in range(3):
        (made_by,) = gate.take_step(step)
        assert made_by == step  # on-policy
        events.append(f"train{step}")
        gate.publish(step + 1)
    gate.close()
    thread.join(timeout=5)
    assert events[:6] == ["roll0@v0", "train0", "roll1@v1", "train1", "roll2@v2", "train2"]


def test_async_lets_rollouts_run_ahead_by_the_bound() -> None:
    gate: StalenessGate[int] = StalenessGate(groups_per_step=1, max_staleness=2)
    versions = [gate.wait_for_weights(gate.claim().step) for _ in range(3)]
    assert versions == [0, 0, 0]  # steps 0..2 all accept version 0
    slot = gate.claim()

    def wait() -> None:
        with pytest.raises(PipelineClosedError):
            gate.wait_for_weights(slot.step)

    blocked = threading.Thread(target=wait)
    blocked.start()
    time.sleep(0.3)
    assert blocked.is_alive()  # step 3 would be 3 versions stale
    gate.close()
    blocked.join(timeout=5)


def test_close_unblocks_the_trainer() -> None:
    gate: StalenessGate[int] = StalenessGate(groups_per_step=1, max_staleness=0)
    errors: list[Exception] = []

    def take() -> None:
        try:
            gate.take_step(0)
        except PipelineClosedError as exc:
            errors.append(exc)

    thread = threading.Thread(target=take)
    thread.start()
    gate.close()
    thread.join(timeout=5)
    assert len(errors) == 1 and gate.trainer_idle.idle_s >= 0
