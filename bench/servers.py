"""Servers as a user runs them, for benches: `flywheel up` and vLLM's own OpenAI server, each
its own process on a free port, and the hot-swap pauses a `flywheel up` reports."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from app.settings import Settings
from ingest.broker import free_port

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def _process(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def wait_answering(url: str, path: str = "/v1/models", *, timeout_s: float = 900,
                   proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    """Poll `url + path` until it answers 200; fail early when `proc` (the server) exits."""
    where = f"; see {log}" if log is not None else ""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited{where}")
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer in {timeout_s:.0f} s{where}")


@contextmanager
def flywheel_up(data_dir: Path, model_dir: Path, **env: str) -> Iterator[str]:
    """`flywheel up` with FLYWHEEL_* `env` on top of ours; yields its URL."""
    port = free_port()
    environ = {**os.environ, "FLYWHEEL_MODEL_DIR": str(model_dir), **env}
    environ.pop("FLYWHEEL_KAFKA_BOOTSTRAP", None)
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / "up.log"
    argv = [sys.executable, "-m", "app.cli", "up", "--port", str(port), "--data-dir",
            str(data_dir)]
    with _process(argv, environ, log) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_answering(url, proc=proc, log=log)
        yield url


@contextmanager
def vllm_server(model_dir: Path, log_dir: Path, *, max_num_seqs: int = 32,
                kv_cache_gib: float = 1.0) -> Iterator[str]:
    """vLLM's OpenAI server on the same model, dtype and KV-cache size as the backend."""
    from serving.vllm_engine import vllm_dtype

    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(model_dir), "--served-model-name", "flywheel", "--port", str(port),
            "--dtype", vllm_dtype(model_dir), "--max-num-seqs", str(max_num_seqs),
            "--kv-cache-memory-bytes", str(int(kv_cache_gib * (1 << 30))), "--seed", "0"]
    log = log_dir / "vllm-server.log"
    with _process(argv, dict(os.environ), log) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_answering(url, proc=proc, log=log)
        yield url


def swap_pauses(url: str, model_dir: Path, data_dir: Path, releases: int = 2) -> list[float]:
    """Publish `releases` candidates (the base weights plus small noise) through the admin API
    and return each hot-swap's admission pause (s) as the replica reports it."""
    import torch

    from trainer.release.weights import load_model, save_weights

    token = Settings(data_dir=data_dir).admin_secret().get_secret_value()
    admin = {"Authorization": f"Bearer {token}"}
    weights = load_model(model_dir).state_dict()
    pauses = []
    with httpx.Client(base_url=url, headers=admin, timeout=60) as http:
        for i in range(releases):
            gen = torch.Generator().manual_seed(i)
            weights = {n: t + 1e-3 * torch.randn(t.shape, generator=gen)
                       for n, t in weights.items()}
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
            ckpt = data_dir / f"bench-candidate-{i}.safetensors"
            save_weights(weights, ckpt)
            r = http.post("/admin/releases", json={"candidate": str(ckpt), "reason": "bench"})
            r.raise_for_status()
            version = r.json()["version"]
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                last = http.get("/admin/status").json()["replica"]["last_swap"]
                if last is not None and last["version"] == version:
                    pauses.append(float(last["paused_s"]))
                    break
                time.sleep(0.5)
            else:
                raise RuntimeError(f"release v{version} was not swapped in")
    return pauses
