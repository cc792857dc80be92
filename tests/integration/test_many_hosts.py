"""The fleet across hosts: five Linux network namespaces joined by veth links, every hop to
the broker through a relay that delays each direction by 25 ms (a round trip between regions).

    broker    Tansu, reached only through the delaying relay
    trainer   `flywheel bootstrap --kafka <relay>` with no workers of its own; then a release
              of what it trained, through the release pipeline (eval gate, delta, announce)
    worker-a  `flywheel rollout-worker`, SIGKILLed once it has begun a batch
    worker-b  `flywheel rollout-worker`
    replica   `flywheel up`, following releases

Kafka records cross the links; the policy and release stores are one directory that every
host mounts (as an NFS share or an object store would be). Needs root and iproute2: skips with
the reason without them, fails instead when CI=true.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ingest.broker import tansu_binary, wait_until_answering
from ingest.config import KafkaConfig
from kernels.weights import state_dict_sha256
from tests.integration.fleet_helpers import (
    assert_each_job_ended_once,
    wait_for_line,
    worker_command,
    worker_env,
)
from tests.integration.helpers import swapped_to
from tests.integration.netns import Hosts, hosts, missing_privileges
from trainer.release.weights import base_weights

REPO = Path(__file__).resolve().parents[2]
DELAY_MS = 25
HOSTS = ("broker", "trainer", "worker-a", "worker-b", "replica")
STEPS, GROUPS_PER_STEP = 8, 4
RELEASE = ("import sys; from pathlib import Path; from app.settings import Settings; "
           "from trainer.release.pipeline import PipelineReleaseSink; "
           "o = PipelineReleaseSink(Settings().release_config()).release("
           "Path(sys.argv[1]), {}, requested_by='trainer host', reason='bootstrap'); "
           "print('RELEASED', o.version, o.published, o.sha256, o.reason, flush=True)")


@pytest.fixture
def net() -> Iterator[Hosts]:
    reason = missing_privileges()
    if reason is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{reason} (CI=true: the many-hosts test must run)")
        pytest.skip(reason)
    with hosts(HOSTS) as made:
        yield made


def start_broker(net: Hosts, logs: Path) -> str:
    """Tansu on the broker host's loopback, advertised (and reachable) only as the relay."""
    relay = f"{net.ip('broker')}:9093"
    net.popen("broker", [tansu_binary(), "broker", "--listener-url", "tcp://127.0.0.1:9092",
                         "--advertised-listener-url", f"tcp://{relay}",
                         "--storage-engine", "memory://tansu/", "--silent"],
              log=logs / "broker.log")
    net.popen("broker", [sys.executable, "-m", "tests.integration.netns", "relay", relay,
                         "127.0.0.1:9092", str(DELAY_MS)], log=logs / "relay.log")
    wait_until_answering(relay, timeout_s=30)
    return relay


@pytest.mark.timeout(600)
def test_a_bootstrap_and_a_release_cross_five_hosts(net: Hosts, learning_model_dir: Path,
                                                    tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    relay = start_broker(net, logs)
    shared = tmp_path / "shared"  # the stores every host mounts
    tasks = {"kind": "jsonl", "path": str(learning_model_dir / "tasks.jsonl"),
             "held_out_fraction": 0.0}
    admin_token = secrets.token_urlsafe(16)  # an operator's own, as on hosts of their own
    common = {**os.environ, "PYTHONPATH": str(REPO), "FLYWHEEL_KAFKA_BOOTSTRAP": relay,
              "FLYWHEEL_MODEL_DIR": str(learning_model_dir), "FLYWHEEL_ADMIN_TOKEN": admin_token,
              "FLYWHEEL_ARTIFACT_STORE_URL": str(shared / "releases"),
              # the gate runs (a short held-out loss); what it lets through is not the point
              "FLYWHEEL_RELEASE": json.dumps({"eval": {"kind": "heldout_loss", "sequences": 2,
                                                       "seq_len": 64, "max_regression": 10}})}

    # the replica, serving the model the bootstrap starts from (its version 0)
    replica_env = {**common, "FLYWHEEL_DATA_DIR": str(tmp_path / "replica"),
                   "FLYWHEEL_HOST": net.ip("replica"), "FLYWHEEL_PORT": "8000"}
    replica = net.popen("replica", [sys.executable, "-m", "app.cli", "up"], log=logs /
                        "replica.log", env=replica_env)
    # two workers, on hosts of their own
    workers = {}
    for name in ("a", "b"):
        env = worker_env(KafkaConfig(bootstrap=relay), shared / "policy",
                         tmp_path / f"worker-{name}")
        workers[name] = net.popen(f"worker-{name}", worker_command(name),
                                  log=logs / f"worker-{name}.log", env={**common, **env})
    # the trainer: a short bootstrap with no workers of its own
    run_dir = tmp_path / "run"
    trainer_env = {**common, "FLYWHEEL_DATA_DIR": str(tmp_path / "trainer"),
                   "FLYWHEEL_BOOTSTRAP": json.dumps({
                       "tasks": tasks, "group_size": 4, "groups_per_step": GROUPS_PER_STEP,
                       "groups_in_flight": 2, "max_tokens": 64, "max_turns": 2, "lr": 1e-3,
                       "rollout_workers": 0, "policy_store_url": str(shared / "policy"),
                       "eval_tasks": 1})}
    trainer = net.popen("trainer", [
        sys.executable, "-m", "app.cli", "bootstrap", "--kafka", relay, "--run-dir",
        str(run_dir), "--max-steps", str(STEPS), "--midtrain-steps", "0",
        "--time-budget-s", "400", "--no-progress"], log=logs / "trainer.log", env=trainer_env)

    wait_for_line(logs / "worker-a.log", r"making \S+ on v", timeout_s=180)
    workers["a"].send_signal(signal.SIGKILL)
    workers["a"].wait(timeout=10)
    assert trainer.wait(timeout=420) == 0, (logs / "trainer.log").read_text()[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert_each_job_ended_once(run_dir / "jobs.jsonl", trained_slots=STEPS * GROUPS_PER_STEP,
                               steps=STEPS, killed="a", killed_log=logs / "worker-a.log",
                               survivor="b")
    assert summary["fleet"]["by_worker"].get("b", 0) > 0
    # the survivor follows the last policy version across the link, to the trainer's weights
    trained = state_dict_sha256(base_weights(run_dir / "model"))
    assert trained != state_dict_sha256(base_weights(learning_model_dir))
    wait_for_line(logs / "worker-b.log", rf"on v{STEPS} sha256 {trained}", timeout_s=60)

    # a release of what the trainer made, built on the trainer host, swapped in by the replica
    released = subprocess.run(
        ["ip", "netns", "exec", net.namespace("trainer"), sys.executable, "-c", RELEASE,
         str(run_dir / "model")], env=trainer_env, cwd=REPO, capture_output=True, text=True,
        timeout=300)
    assert released.returncode == 0, released.stderr[-4000:]
    version, published, sha, *_ = released.stdout.split("RELEASED")[-1].split()
    assert published == "True" and sha == trained, released.stdout
    with httpx.Client(base_url=f"http://{net.ip('replica')}:8000", timeout=30, headers={
            "Authorization": f"Bearer {admin_token}"}) as http:
        status = swapped_to(http, int(version), timeout_s=120)
        assert status["last_swap"]["live_sha256"] == trained
        reply = http.post("/v1/chat/completions", json={
            "model": "flywheel", "max_tokens": 4,
            "messages": [{"role": "user", "content": "def plus_one(x):"}]})
        assert reply.status_code == 200, reply.text
    assert replica.poll() is None, (logs / "replica.log").read_text()[-4000:]
