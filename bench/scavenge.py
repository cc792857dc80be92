"""Off-peak scavenging: users' latency on a replica with scavenging off and on, same load.

A bootstrap runs on its own broker with no workers of its own (`nice -n 19`: it stands for
the training cluster, another host), so rollouts come only from the replica's scavenger. The
replica is `flywheel up` (the torch engine), once with scavenging off and once on. The same
open-loop load runs against each: `--cycles` of `--busy-s` seconds of chat requests (32
tokens) arriving every 1/`--rps` s, then `--idle-s` seconds of silence, when a scavenging
replica joins the rollout workers. Figures: users' p50/p99 latency off and on, their ratio,
and what the scavenger made.

    python bench/scavenge.py [--cycles 3] [--busy-s 8] [--idle-s 12] [--rps 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.settings import Settings  # noqa: E402
from bench.servers import ROOT, flywheel_up  # noqa: E402
from ingest.broker import EmbeddedBroker  # noqa: E402


async def load(url: str, *, cycles: int, busy_s: float, idle_s: float, rps: float
               ) -> tuple[list[float], int]:
    """Open-loop load: a request every 1/rps s during each busy period; (latencies, errors)."""
    latencies: list[float] = []
    errors = 0

    async def one(http: httpx.AsyncClient, i: int) -> None:
        nonlocal errors
        start = time.perf_counter()
        r = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": f"def f{i}(x):"}], "max_tokens": 32,
            "temperature": 0.8})
        if r.status_code == 200:
            latencies.append(time.perf_counter() - start)
        else:
            errors += 1

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        sent, pending = 0, []
        for _ in range(cycles):
            await asyncio.sleep(idle_s)
            end = time.monotonic() + busy_s
            while time.monotonic() < end:
                pending.append(asyncio.create_task(one(http, sent)))
                sent += 1
                await asyncio.sleep(1 / rps)
        await asyncio.gather(*pending)
    return latencies, errors


def phase(name: str, work: Path, model_dir: Path, args: argparse.Namespace,
          **env: str) -> dict:
    with flywheel_up(work / name, model_dir, **env) as url:
        latencies, errors = asyncio.run(load(url, cycles=args.cycles, busy_s=args.busy_s,
                                             idle_s=args.idle_s, rps=args.rps))
        token = Settings(data_dir=work / name).admin_secret().get_secret_value()
        status = httpx.get(f"{url}/admin/status", timeout=30,
                           headers={"Authorization": f"Bearer {token}"}).json()
    ms = np.array(latencies) * 1000
    print(f"{name}: {len(ms)} requests, p50 {np.percentile(ms, 50):.0f} ms, "
          f"p99 {np.percentile(ms, 99):.0f} ms, errors {errors}, "
          f"scavenger {status['scavenger']}", flush=True)
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "requests": len(ms), "errors": errors, "scavenger": status["scavenger"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--busy-s", type=float, default=8.0)
    parser.add_argument("--idle-s", type=float, default=12.0)
    parser.add_argument("--rps", type=float, default=4.0)
    args = parser.parse_args()

    from trainer.config import TinyModelSettings
    from trainer.init_model import init_model

    work = Path(tempfile.mkdtemp(prefix="bench-scavenge-"))
    model_dir = init_model(TinyModelSettings(), work / "model")
    broker = EmbeddedBroker.start(log_path=work / "broker.log")
    store = work / "policy"
    trainer_env = {**os.environ, "FLYWHEEL_MODEL_DIR": str(model_dir),
                   "FLYWHEEL_BOOTSTRAP": json.dumps({
                       "rollout_workers": 0, "policy_store_url": str(store), "eval_tasks": 1,
                       "group_size": 4, "groups_per_step": 2, "max_turns": 2,
                       "max_tokens": 32})}
    with (work / "trainer.log").open("w") as out:
        trainer = subprocess.Popen(
            ["nice", "-n", "19", sys.executable, "-m", "app.cli", "bootstrap", "--kafka",
             broker.bootstrap, "--run-dir", str(work / "run"), "--data-dir",
             str(work / "trainer"), "--midtrain-steps", "0", "--max-steps", "100000",
             "--time-budget-s", "3600", "--no-progress"],
            stdout=out, stderr=subprocess.STDOUT, env=trainer_env, cwd=ROOT)
    try:
        off = phase("off", work, model_dir, args)
        on = phase("on", work, model_dir, args, FLYWHEEL_SCAVENGE__ENABLED="true",
                   FLYWHEEL_SCAVENGE__KAFKA_BOOTSTRAP=broker.bootstrap,
                   FLYWHEEL_SCAVENGE__STORE_URL=str(store),
                   FLYWHEEL_SCAVENGE__WINDOW_S="2", FLYWHEEL_SCAVENGE__MAX_RPS="1",
                   FLYWHEEL_SCAVENGE__QUIET_S="1")
    finally:
        trainer.terminate()
        trainer.wait(timeout=60)
        broker.stop()
    scavenger = on["scavenger"]
    print(json.dumps({
        "bench": "scavenge", "p50_ms_off": round(off["p50_ms"], 1),
        "p99_ms_off": round(off["p99_ms"], 1), "p50_ms_on": round(on["p50_ms"], 1),
        "p99_ms_on": round(on["p99_ms"], 1),
        "ratio_p50": round(on["p50_ms"] / off["p50_ms"], 3),
        "ratio_p99": round(on["p99_ms"] / off["p99_ms"], 3),
        "requests": {"off": off["requests"], "on": on["requests"]},
        "errors": off["errors"] + on["errors"], "scavenged_groups": scavenger["groups"],
        "scavenged_samples": scavenger["samples"], "preemptions": scavenger["preemptions"],
        "jobs_handed_back": scavenger["jobs_handed_back"]}))


if __name__ == "__main__":
    main()
