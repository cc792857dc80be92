"""Chaos at world size 2: SIGKILL one rank of `flywheel train-online --nproc 2` ten times.

The real command on the real broker: torch's elastic agent runs two gloo ranks (FSDP2); the
test SIGKILLs one of them, leader or follower at random, at a random moment after both are up
(loading, training, checkpointing). The agent notices, stops the other rank, and starts both
again, which resume from the last sharded checkpoint. The last start runs to `stop_after`.
Then the ledger must hold every experience exactly once and the command must exit 0.

    python -m pytest tests/integration/test_online_chaos_sharded.py -s
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.settings import Settings
from ingest.config import KafkaConfig
from tests.integration.helpers import produce_experiences
from trainer.checkpoint import CheckpointStore

KILLS = 10
EXPERIENCES = 160
REPO = Path(__file__).resolve().parents[2]


def _ranks(agent: int) -> list[int]:
    """The pids of the agent's live rank processes, in start order (rank 0 first): its
    children that multiprocessing spawned, not its resource tracker (read from /proc)."""
    found = []
    for child in Path(f"/proc/{agent}/task/{agent}/children").read_text().split():
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue  # exited meanwhile
        if b"spawn_main" in cmdline:
            found.append(int(child))
    return sorted(found)


def _wait_for_new_ranks(agent: subprocess.Popen[str], old: set[int]) -> list[int]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and agent.poll() is None:
        ranks = _ranks(agent.pid)
        if len(ranks) == 2 and not set(ranks) & old:
            return ranks
        time.sleep(0.05)
    raise AssertionError(f"no new pair of ranks came up (agent exit {agent.poll()})")


def _durable_step(store: CheckpointStore) -> int:
    latest = store.load()
    return latest.state["step"] if latest is not None else 0


def _wait_for_step_past(store: CheckpointStore, step: int, agent: subprocess.Popen[str]
                        ) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and agent.poll() is None:
        if _durable_step(store) > step:
            return
        time.sleep(0.02)
    raise AssertionError(f"no step after {step} (agent exit {agent.poll()})")


@pytest.mark.timeout(600)
def test_sigkill_a_rank_ten_times_trains_each_experience_once(
        settings: Settings, kafka: KafkaConfig, model_dir: Path) -> None:
    experiences = produce_experiences(kafka, model_dir)
    online = {"min_batch": 4, "max_batch": 4, "deterministic": True, "lr": 1e-3,
              "stop_after": EXPERIENCES, "poll_timeout_ms": 100, "group_id": "chaos-sharded",
              "max_restarts": KILLS + 2, "collective_timeout_s": 60}
    env = {**os.environ, "PYTHONPATH": str(REPO), "FLYWHEEL_MODEL_DIR": str(model_dir),
           "FLYWHEEL_KAFKA_BOOTSTRAP": kafka.bootstrap,
           "FLYWHEEL_TOPICS": kafka.topics.model_dump_json(), "FLYWHEEL_ONLINE": json.dumps(online),
           "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "train-online", "--nproc", "2", "--no-release",
         "--data-dir", str(settings.data_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    rng = random.Random(17)
    store = CheckpointStore(settings.online.resolved_checkpoint_dir(settings.data_dir))
    killed: list[int] = []
    steps_at_kill: list[int] = []  # the last durable step when each kill landed
    try:
        seen: set[int] = set()
        for _ in range(KILLS):
            ranks = _wait_for_new_ranks(agent, seen)
            seen |= set(ranks)
            if rng.random() < 0.3:  # while they start: import, rendezvous, restore
                time.sleep(rng.uniform(0.5, 3.0))
            else:  # while they train: once this life made a step durable
                _wait_for_step_past(store, steps_at_kill[-1] if steps_at_kill else 0, agent)
                time.sleep(rng.uniform(0.0, 1.0))
            rank = rng.randrange(2)
            try:
                os.kill(ranks[rank], signal.SIGKILL)
            except ProcessLookupError:
                agent.kill()
                raise AssertionError(f"rank {rank} was already gone:\n"
                                     f"{agent.communicate()[0][-4000:]}") from None
            killed.append(rank)
            steps_at_kill.append(_durable_step(store))
        out = agent.communicate(timeout=300)[0]
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, out[-4000:]
    # the agent says which rank died and how, then starts them again
    assert out.count("terminated with signal SIGKILL") >= KILLS, out[-4000:]
    assert f"trained {EXPERIENCES} experiences" in out, out[-2000:]

    ckpt = store.load()
    assert ckpt is not None
    trained = [i for entry in ckpt.ledger.entries for i in entry.experience_ids]
    assert sorted(trained) == sorted(e.experience_id for e in experiences), \
        "every experience exactly once"
    assert [e.step for e in ckpt.ledger.entries] == list(range(len(ckpt.ledger.entries)))
    print(f"\nsharded chaos: SIGKILLed ranks {killed} at durable steps {steps_at_kill}, "
          f"{len(ckpt.ledger.entries)} steps, {len(trained)} experiences once each")
    lives_that_trained = sum(b > a for a, b in zip([0, *steps_at_kill], steps_at_kill,
                                                   strict=False))
    assert steps_at_kill[-1] < len(ckpt.ledger.entries), "the last kill came too late"
    assert lives_that_trained >= KILLS // 2, "most kills must land while the ranks train"
