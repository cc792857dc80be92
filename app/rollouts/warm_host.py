"""The worker's side of an entry point's warm host (simulate/agent_host.py): one host process,
started on first use and again after it died, forking an episode per request.

It is reached from each batch's own event loop (the rollout worker runs one per batch), so the
host is a plain process read by a thread, which hands each answer to the loop that waits for it.

    host = WarmHost(argv)
    code, pid = await host.run(request, deadline_s=300)   # code None: past the deadline, killed
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

HOST_DIED = 255  # an episode's exit code when its host died under it


@dataclass
class _Waiter:
    loop: asyncio.AbstractEventLoop
    host: subprocess.Popen[bytes] | None = None  # the host its request went to
    pid: asyncio.Future[int] = field(init=False)
    code: asyncio.Future[int] = field(init=False)

    def __post_init__(self) -> None:
        self.pid, self.code = self.loop.create_future(), self.loop.create_future()

    def settle(self, future: asyncio.Future[int], value: int) -> None:
        """From the reader thread: set `future` on its own loop (once)."""
        def settle() -> None:
            if not future.done():
                future.set_result(value)
        self.loop.call_soon_threadsafe(settle)


class WarmHost:
    """Episodes forked by one warm host of `argv` (its stderr: the worker's)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.argv, self.env = argv, env
        self._proc: subprocess.Popen[bytes] | None = None
        self._waiting: dict[str, _Waiter] = {}
        self._lock = threading.Lock()

    async def run(self, request: dict[str, Any], *, deadline_s: float) -> int | None:
        """Fork `request`'s episode and wait for it: its exit code, or None when it ran past
        `deadline_s` (its process group is then killed). The group is killed at the end
        either way, as a started process's is."""
        waiter = _Waiter(asyncio.get_running_loop())
        episode = request["episode"]
        with self._lock:
            self._waiting[episode] = waiter
            waiter.host = self._started()
            try:
                assert waiter.host.stdin is not None
                waiter.host.stdin.write((json.dumps(request) + "\n").encode())
                waiter.host.stdin.flush()
            except OSError:  # the host died just now
                waiter.settle(waiter.pid, -1)
                waiter.settle(waiter.code, HOST_DIED)
        try:
            pid = await waiter.pid
            if pid < 0:
                return HOST_DIED
            try:
                return await asyncio.wait_for(asyncio.shield(waiter.code), timeout=deadline_s)
            except TimeoutError:
                return None
            finally:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                await waiter.code  # the host reaps it
        finally:
            with self._lock:
                self._waiting.pop(episode, None)

    def _started(self) -> subprocess.Popen[bytes]:
        """The running host, a new one started first if there is none (under the lock)."""
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, env=self.env,
                                          start_new_session=True)
            threading.Thread(target=self._read, args=(self._proc,), name="agent-host",
                             daemon=True).start()
        return self._proc

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        """Hand the host's answers to their waiters; when it dies, settle every waiter it
        held (a pid of -1, an exit code of HOST_DIED)."""
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                answer = json.loads(line)
            except json.JSONDecodeError:  # not the host's: a stray line, logged
                log.warning("agent host: %s", line[:500].decode(errors="replace").rstrip())
                continue
            with self._lock:
                waiter = self._waiting.get(answer["episode"])
            if waiter is None:
                continue
            if "pid" in answer:
                waiter.settle(waiter.pid, int(answer["pid"]))
            else:
                waiter.settle(waiter.code, int(answer["code"]))
        proc.wait()
        with self._lock:
            orphans = [w for w in self._waiting.values() if w.host is proc]
        for waiter in orphans:
            waiter.settle(waiter.pid, -1)
            waiter.settle(waiter.code, HOST_DIED)

    def close(self) -> None:
        """Stop the host: its stdin closes, it kills the episodes still running and exits."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
