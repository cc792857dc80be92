"""The rubric judge of tests/simulate: a real local HTTP server speaking OpenAI's chat API."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class FakeJudge(BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint with a fixed reply; records what it was sent."""

    reply = "The solution is correct and clear. Score: 7"
    status = 200
    received: list[tuple[str, dict]] = []
    sent_headers: list[dict[str, str]] = []  # what each request carried

    def do_POST(self) -> None:  # noqa: N802 - the http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeJudge.received.append((self.path, body))
        FakeJudge.sent_headers.append(dict(self.headers.items()))
        payload = json.dumps({"id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "finish_reason": "stop",
             "message": {"role": "assistant", "content": self.reply}}]}).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def judge_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeJudge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    FakeJudge.received.clear()
    FakeJudge.sent_headers.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()
    FakeJudge.reply, FakeJudge.status = "The solution is correct and clear. Score: 7", 200
