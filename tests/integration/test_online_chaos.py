"""Chaos: SIGKILL the online trainer at 20 random moments on the real broker.

Real `ExperienceReady` records (tokens sampled from the tiny model, their logprobs and MoE
routes) go to the `experiences` topic, a few of them twice, as a join replaying after a crash
would. Trainer processes are forked from a zygote that has torch imported already (a cold
`import transformers` costs seconds on a shared CPU), and each is SIGKILLed by its PID at a
random moment: while loading, training, checkpointing or committing. The last one runs to the
end. Then the ledger must hold every experience exactly once, and the weights must equal,
bit for bit, those of one uninterrupted trainer fed the same batches (deterministic mode).

    python -m pytest tests/integration/test_online_chaos.py -s
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from app.settings import Settings
from ingest.config import KafkaConfig
from tests.integration.helpers import DUPLICATES, EXPERIENCES, produce_experiences
from trainer.checkpoint import CheckpointStore
from trainer.online.trainer import OnlineTrainer

KILLS = 20
REPO = Path(__file__).resolve().parents[2]


def _zygote(settings_json: str) -> None:
    """Import torch and the trainer once; fork a trainer per `go` line on stdin."""
    # The expensive imports (seconds on a shared CPU), paid once, before any fork.
    from transformers import AutoModelForCausalLM  # noqa: F401
    from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: F401

    from trainer.online.process import run_online

    settings = Settings.model_validate_json(settings_json)
    torch.set_num_threads(1)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                run_online(settings)
                code = 0
            finally:
                os._exit(code)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {pid} {status}", flush=True)


def _settings(settings: Settings) -> Settings:
    online = settings.online.model_copy(update={
        "min_batch": 4, "max_batch": 4, "deterministic": True, "lr": 1e-3,
        "stop_after": EXPERIENCES, "poll_timeout_ms": 100, "checkpoint_every_steps": 1,
        "group_id": "chaos-trainer"})
    return settings.model_copy(update={"online": online})


@pytest.mark.timeout(300)
def test_sigkill_twenty_times_trains_each_experience_once_and_bitwise(
        settings: Settings, kafka: KafkaConfig, model_dir: Path) -> None:
    started = time.monotonic()
    settings = _settings(settings)
    experiences = produce_experiences(kafka, model_dir)
    produced_s = time.monotonic() - started
    by_id = {e.experience_id: e for e in experiences}
    zygote = subprocess.Popen([sys.executable, __file__, "--zygote", settings.model_dump_json()],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert zygote.stdin is not None and zygote.stdout is not None
    rng = random.Random(11)
    kills, finished = 0, False
    try:
        while not finished:
            zygote.stdin.write("go\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline().split()[1])
            if kills < KILLS:
                time.sleep(rng.uniform(0.05, 0.8))
                os.kill(pid, signal.SIGKILL)
            status = int(zygote.stdout.readline().split()[2])
            killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
            kills += killed
            finished = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
            assert killed or finished, f"trainer {pid} failed with status {status}"
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=30)
    chaos_s = time.monotonic() - started - produced_s

    root = settings.online.resolved_checkpoint_dir(settings.data_dir)
    ckpt = CheckpointStore(root).load()
    assert ckpt is not None
    trained = [i for entry in ckpt.ledger.entries for i in entry.experience_ids]
    assert sorted(trained) == sorted(by_id), "every experience exactly once"
    assert [e.step for e in ckpt.ledger.entries] == list(range(len(ckpt.ledger.entries)))

    replay_started = time.monotonic()
    threads = torch.get_num_threads()
    try:
        reference = OnlineTrainer.restore(settings.online, model_dir, settings.data_dir / "ref")
        for entry in ckpt.ledger.entries:
            reference.step([by_id[i] for i in entry.experience_ids])
        survivor = OnlineTrainer.restore(settings.online, model_dir, root).model.state_dict()
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)
    mismatched = [name for name, tensor in reference.model.state_dict().items()
                  if not torch.equal(tensor, survivor[name])]
    assert not mismatched, f"weights differ from the uninterrupted run: {mismatched[:5]}"
    print(f"\nchaos: {kills} SIGKILLs, {len(ckpt.ledger.entries)} steps, {len(trained)} "
          f"experiences once each (+{DUPLICATES} replayed duplicates skipped), bitwise equal "
          f"weights; produce {produced_s:.1f}s, kill/restart loop {chaos_s:.1f}s, "
          f"uninterrupted replay {time.monotonic() - replay_started:.1f}s")
    assert kills >= KILLS


if __name__ == "__main__" and sys.argv[1:2] == ["--zygote"]:
    _zygote(sys.argv[2])
