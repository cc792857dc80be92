"""A scripted agent program for the agent-rollout tests: `python scripted_agent.py BEHAVIOR
REPORT_DIR`, or `main(BEHAVIOR, REPORT_DIR)` from an entry point. It makes two chat
completions on the endpoint it is given (the second sending the first reply back), writes
`solution.py` and reports an accepting verdict on its session, except where BEHAVIOR says
otherwise; once per REPORT_DIR (a marker file), a misbehaving BEHAVIOR
misbehaves, so that the remade episode then behaves. It writes what it saw to REPORT_DIR."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import openai

from ingest.signing import SIGNATURE_HEADER, sign


def verdict(session_id: str) -> int:
    body = json.dumps({"event_id": f"v-{session_id}", "session_id": session_id,
                       "kind": "accept"}).encode()
    reply = httpx.post(os.environ["FLYWHEEL_FEEDBACK_URL"], content=body, headers={
        SIGNATURE_HEADER: sign(os.environ["FLYWHEEL_FEEDBACK_SECRET"], None, body)})
    return reply.status_code


def main(behavior: str, report_dir: Path) -> int:
    session = os.environ["FLYWHEEL_SESSION_ID"]
    # the first episode to create the marker misbehaves, the others behave: episodes of a
    # group run at once, so the test and the creation are one step (O_EXCL)
    try:
        os.close(os.open(report_dir / f"{behavior}.misbehaved", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        behavior = "well"
    client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL, OPENAI_API_KEY
    temperature = 0.5 if behavior == "temperature" else None
    messages = [{"role": "system", "content": "Fix solution.py."},
                {"role": "user", "content": "def f(x):\n    pass\n"}]
    seen = []
    for turn in range(5 if behavior == "flood" else 2):
        try:
            reply = client.chat.completions.create(
                model="flywheel", messages=messages, max_tokens=8, logprobs=True,
                temperature=temperature, seed=int(os.environ["FLYWHEEL_SEED"]) + turn)
        except openai.RateLimitError:
            (report_dir / "refused").write_text(str(turn))
            return 0
        if behavior == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        text = reply.choices[0].message.content or ""
        seen.append({"logprobs": [t.logprob for t in reply.choices[0].logprobs.content],
                     "completion_tokens": reply.usage.completion_tokens})
        # "rewrite": the history sent back is not what the model said
        messages.append({"role": "assistant",
                         "content": "I rewrote this turn." if behavior == "rewrite" else text})
        messages.append({"role": "user", "content": "Go on."})
    (report_dir / f"{session}.json").write_text(json.dumps(seen))
    workspace = Path(os.environ["FLYWHEEL_WORKSPACE"])
    task = json.loads(Path(os.environ["FLYWHEEL_TASK"]).read_text())
    (workspace / "solution.py").write_text(task["prompt"] + task["canonical_solution"])
    if behavior == "hang":
        time.sleep(3600)
    if behavior == "silent":
        return 0
    if behavior == "forge":
        (report_dir / "forged").write_text(str(verdict("rollout-someone-else")))
        return 0
    if behavior == "crash":
        raise RuntimeError("the agent crashed")
    return 0 if verdict(session) == 202 else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
