"""Hostile requests against a running stack: each is refused at once with a 4xx in the API's
one error shape, never a 5xx, a hang or a whole read of an oversized body."""

from __future__ import annotations

import functools
import logging
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given
from hypothesis import settings as examples
from hypothesis import strategies as st
from transformers import AutoTokenizer

from app.api.main import create_app
from app.api.token_bytes import max_token_bytes
from app.cli.stack import RunningStack, running_stack
from app.settings import Settings
from ingest.broker import EmbeddedBroker
from tests.app.api.helpers import admin_client
from tests.conftest import stack_settings

pytestmark = pytest.mark.integration
CHAT = "/v1/chat/completions"
LIMIT = 16384


@pytest.fixture(scope="module")
def stack(broker: EmbeddedBroker, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[RunningStack]:
    settings = stack_settings(broker, model_dir, tmp_path_factory.mktemp("hostile"),
                              max_body_bytes=LIMIT, engine={"max_new_tokens_cap": 8})
    with running_stack(settings) as running:
        yield running


@pytest.fixture
def http(stack: RunningStack) -> Iterator[httpx.Client]:
    with admin_client(stack) as client:
        yield client


def error_of(r: httpx.Response, status: int) -> dict:
    """The error body, after checking the status and the one shape every error has."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert {"message", "type", "param", "code", "request_id"} <= set(error), r.text
    assert error["request_id"] == r.headers["x-request-id"]
    return error  # type: ignore[no-any-return]


def chat(**extra: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


@pytest.mark.parametrize("method, path", [("GET", "/admin/releases/{}"),
                                          ("POST", "/admin/releases/{}/rollback")])
def test_a_version_beyond_64_bits_is_refused(http: httpx.Client, method: str,
                                             path: str) -> None:
    error = error_of(http.request(method, path.format(2**64)), 422)
    assert error["param"] == "path.version"
    error_of(http.request(method, path.format(-1)), 422)


def test_a_seed_beyond_64_bits_is_refused_not_hung(http: httpx.Client) -> None:
    error = error_of(http.post(CHAT, json=chat(seed=2**64)), 400)
    assert error["param"] == "seed"
    for seed in (-(2**63), 2**63 - 1):  # the ends of the range sample (with n=2: seed + 1)
        r = http.post(CHAT, json=chat(seed=seed, n=2))
        assert r.status_code == 200, r.text


def test_nan_and_infinity_are_refused_as_not_finite(http: httpx.Client) -> None:
    for value in ("NaN", "Infinity", "-Infinity"):
        body = f'{{"messages": [{{"role": "user", "content": "hi"}}], "temperature": {value}}}'
        r = http.post(CHAT, content=body, headers={"content-type": "application/json"})
        error = error_of(r, 400)
        assert error["param"] == "temperature" and "finite" in error["message"], error


def test_vanishing_top_p_and_temperature_sample_greedily(http: httpx.Client) -> None:
    """The fuzzer's find: top_p 5e-324 emptied the nucleus (a 500); a temperature near 1e-300
    overflows logits / T. Both have greedy decoding as their limit, and get it."""
    greedy = http.post(CHAT, json=chat(temperature=0)).json()["choices"][0]["message"]
    for extreme in ({"top_p": 5e-324}, {"temperature": 1e-300}, {"temperature": 5e-324}):
        r = http.post(CHAT, json=chat(**extreme))
        assert r.status_code == 200, (extreme, r.text)
        if "temperature" in extreme:
            assert r.json()["choices"][0]["message"] == greedy


def test_a_request_may_not_ask_for_unbounded_generations(http: httpx.Client) -> None:
    error = error_of(http.post("/v1/completions", json={"prompt": ["a"] * 65, "max_tokens": 1}),
                     400)
    assert error["param"] == "prompt"
    error = error_of(http.post("/v1/completions", json={"prompt": ["a"] * 8, "n": 16,
                                                       "max_tokens": 1}), 400)
    assert error["param"] == "n"


def test_a_release_candidate_must_lie_under_the_data_dir(http: httpx.Client,
                                                         stack: RunningStack) -> None:
    for candidate in ("../../../../etc", "/etc/passwd", "x\x00y", "a" * 4000):
        error = error_of(http.post("/admin/releases", json={"candidate": candidate}), 400)
        assert error["code"] == "path_not_allowed", error
    inside = stack.settings.data_dir / "checkpoints" / "nothing-here"
    error = error_of(http.post("/admin/releases", json={"candidate": str(inside)}), 404)
    assert error["code"] == "candidate_not_found"
    assert http.get("/admin/releases").json() == []  # no version was reserved for any


def test_the_admin_token_is_the_data_dirs_own_and_nowhere_in_answers(
        stack: RunningStack, http: httpx.Client) -> None:
    """No FLYWHEEL_ADMIN_TOKEN: the data dir's random token opens the admin routes, the
    constant earlier versions defaulted to does not, and no answer carries a secret."""
    assert stack.settings.admin_token is None
    token = (stack.settings.data_dir / "admin_token").read_text().strip()
    for guess in ("flywheel-admin", "x", token[:-1]):
        error = error_of(http.get("/admin/status", headers={"Authorization": f"Bearer {guess}"}),
                         401)
        assert token not in str(error)
    status = http.get("/admin/status")
    assert status.status_code == 200
    secrets = [token] + [s.get_secret_value() for s in stack.settings.feedback_secrets]
    for answer in (status.text, http.get("/admin/console").text, http.get("/metrics").text):
        assert not any(s in answer for s in secrets)


def test_every_family_answers_errors_in_one_shape(http: httpx.Client) -> None:
    error_of(http.get("/admin/releases", headers={"Authorization": "Bearer wrong"}), 401)
    error_of(http.get("/admin/releases/7"), 404)
    error_of(http.get("/admin/releases", params={"status": "bogus"}), 422)
    error_of(http.get("/no/such/route"), 404)
    error_of(http.post("/v1/feedback", json={"event_id": "e", "kind": "accept"}), 422)
    error_of(http.post(CHAT, json={"messages": []}), 400)
    error_of(http.delete("/healthz"), 405)


def _chunked_upload(url: str, path: str, total: int) -> tuple[int, bytes]:
    """POST `total` bytes chunked, a little at a time, until the server answers; the bytes
    sent by then and the answer."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=20) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                     "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                     .encode())
        sent, chunk = 0, b'{"messages": [{"role": "user", "content": "' + b"x" * 2000
        while sent < total and not select.select([sock], [], [], 0.005)[0]:
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:  # the server answered and closed
                break
            sent += len(chunk)
        answer = b""
        while b"\r\n\r\n" not in answer:
            data = sock.recv(65536)
            if not data:
                break
            answer += data
        return sent, answer


def test_a_chunked_body_is_cut_at_the_limit_while_others_are_served(
        stack: RunningStack, http: httpx.Client) -> None:
    served: list[int] = []
    stop = threading.Event()

    def others() -> None:
        with httpx.Client(base_url=stack.base_url, timeout=20) as client:
            while not stop.is_set():
                served.append(client.post(CHAT, json=chat()).status_code)

    thread = threading.Thread(target=others)
    thread.start()
    try:
        time.sleep(0.5)
        for path in (CHAT, "/v1/feedback"):
            sent, answer = _chunked_upload(stack.base_url, path, total=10_000_000)
            assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
            assert sent < 20 * LIMIT, f"{sent} bytes were read before the cut"
    finally:
        stop.set()
        thread.join()
    assert served and set(served) == {200}, served


def test_an_unhandled_error_is_a_json_500_whose_id_is_in_the_log(
        settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    app = create_app(settings)

    def boom() -> None:
        raise RuntimeError("the disk caught fire")

    app.add_api_route("/boom", boom)
    with TestClient(app) as client, caplog.at_level(logging.ERROR, logger="app.api.guard"):
        error = error_of(client.get("/boom"), 500)
    assert error["type"] == "server_error" and "fire" not in error["message"]
    logged = [r for r in caplog.records if error["request_id"] in r.getMessage()]
    assert logged and logged[0].exc_info is not None


def test_the_document_describes_every_body_and_error(stack: RunningStack) -> None:
    doc = httpx.get(f"{stack.base_url}/openapi.json").json()
    feedback = doc["paths"]["/v1/feedback"]["post"]
    assert feedback["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/FeedbackRequest"}
    assert {"401", "413", "422"} <= set(feedback["responses"])
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            errors = {s: r for s, r in op["responses"].items() if s >= "400"}
            assert "500" in errors, (method, path)
            for status, answer in errors.items():
                schema = answer["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (
                    method, path, status)


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(
        broker: EmbeddedBroker, model_dir: Path, tmp_path: Path) -> None:
    """Tokenizing a 1 MB prompt holds the event loop ~0.5 s; its size alone shows it cannot
    fit, so it is refused from that (the message gives the bound, not a token count)."""
    settings = stack_settings(broker, model_dir, tmp_path, max_body_bytes=2_000_000)
    with running_stack(settings) as running, httpx.Client(base_url=running.base_url,
                                                           timeout=20) as client:
        for url, body in ((CHAT, {"messages": [{"role": "user", "content": "x" * 1_000_000}]}),
                          ("/v1/completions", {"prompt": ["hi", "y" * 1_000_000]})):
            error = error_of(client.post(url, json=body), 400)
            assert error["code"] == "context_length_exceeded"
            assert "at least" in error["message"], error


@functools.cache
def tokenizer_in(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(model_dir)


@given(text=st.one_of(st.text(max_size=3000), st.sampled_from(["#" * 80, " " * 3000, "é" * 999])))
@examples(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_no_token_stands_for_more_bytes_than_the_bound(model_dir: Path, text: str) -> None:
    tokenizer = tokenizer_in(model_dir)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(text.encode()) <= len(ids) * max_token_bytes(tokenizer)
