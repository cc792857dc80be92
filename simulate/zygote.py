"""Start sandbox jobs by forking a warm interpreter instead of starting a fresh one.

A fresh `python -I -B sandbox_child.py` costs ~45 ms of CPU before the job's first line (the
interpreter, `site` and its editable-install hooks, and the child's imports), about a quarter of
a GRPO step's CPU on the default model. The zygote (`sandbox_child.zygote`) is one such
interpreter per supervising process (and the forks it makes after starting it:
`warm_zygote`), started without `site` (the venv's site-packages are put
on its path directly, so jobs can still import installed packages); it forks a reaper and a job
per request. The job is what `Popen(start_new_session=True, …)` made before: its own session,
cwd, scrubbed environment and descriptors, then `sandbox_child.main`.

    process = spawn_job(cwd=workspace, env=env, spec=spec_file, channel=channel, out=out, err=err)
    exited = process.wait_exit(timeout=20.0)   # False: still running at the timeout
    code = process.kill_group()                # kill its process group, reap it, exit code
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path
from typing import IO

_CHILD = Path(__file__).with_name("sandbox_child.py")


class ZygoteError(RuntimeError):
    """The zygote could not start a job, even after a restart."""


class SandboxProcess:
    """A job started by the zygote, seen through its reaper (the job is not our child)."""

    def __init__(self, reply: socket.socket) -> None:
        self._reply = reply
        kind, _, pid = reply.recv(64).decode().partition(" ")
        if kind != "pid":
            raise ZygoteError(f"zygote reaper said {kind!r} instead of a pid")
        self.pid = int(pid)
        self.returncode: int | None = None
        self._exited = self._reaper_lost = False

    def wait_exit(self, timeout: float) -> bool:
        """Block until the job exits (True) or `timeout` passes (False)."""
        if not self._exited:
            readable, _, _ = select.select([self._reply], [], [], timeout)
            if readable:  # b"exited", or b"" if the reaper itself was killed
                self._exited, self._reaper_lost = True, self._reply.recv(64) != b"exited"
        return self._exited

    def kill_group(self) -> int | None:
        """SIGKILL the job's process group (the exited job's zombie still pins it), reap the
        job, and return its exit code, negative for a signal, as `Popen.returncode`; None if
        its reaper was killed (by a job running as our own uid), after killing the group."""
        try:
            if self._reaper_lost:
                raise ConnectionError("reaper gone")
            self._reply.send(b"kill")
            while (message := self._reply.recv(64)) == b"exited":
                continue
            kind, _, code = message.decode().partition(" ")
            if kind != "status":
                raise ConnectionError(f"reaper said {message!r}")
            self.returncode = int(code)
        except OSError:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # the group is already gone
        finally:
            self._reply.close()
        return self.returncode


class _Zygote:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner = -1  # the pid that started it: a forked supervisor needs its own
        self._process: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None

    def spawn(self, request: dict[str, object], fds: list[int]) -> SandboxProcess:
        for attempt in (1, 2):  # a dead zygote is restarted once
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                with self._lock:
                    control = self._running()
                    socket.send_fds(control, [json.dumps(request).encode()],
                                    [*fds, theirs.fileno()])
                theirs.close()
                return SandboxProcess(ours)
            except (OSError, ZygoteError) as exc:
                ours.close()
                theirs.close()
                self.close()
                if attempt == 2:
                    raise ZygoteError(f"the sandbox zygote failed twice: {exc}") from exc
        raise AssertionError("unreachable")

    def _running(self) -> socket.socket:
        if self._control is not None and self._process is not None and self._alive():
            return self._control
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        site_dirs = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
        self._process = subprocess.Popen(
            [sys.executable, "-I", "-B", "-S", str(_CHILD), "--zygote", str(theirs.fileno()),
             *site_dirs], env={"PATH": os.defpath, "LANG": "C.UTF-8"},
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        theirs.close()
        self._control, self._owner = ours, os.getpid()
        return ours

    def _alive(self) -> bool:
        """Whether the zygote runs. A fork of the process that started it (an agent episode
        forked from its warm host, simulate/agent_host.py) shares it: it serves whoever holds
        its control socket (each request is one message, each job answers on a socket of its
        own), though only its parent can poll it."""
        assert self._process is not None
        if self._owner == os.getpid():
            return self._process.poll() is None
        try:
            os.kill(self._process.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def warm(self) -> None:
        """Start the zygote now, so that forks made from here on share it."""
        with self._lock:
            self._running()

    def close(self) -> None:
        """Stop the zygote (it exits when its control socket closes); jobs are unaffected."""
        with self._lock:
            if self._control is not None:
                self._control.close()
            if self._process is not None and self._owner == os.getpid():
                try:
                    self._process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._process.kill()
                    self._process.wait()
            self._control = self._process = None


_zygote = _Zygote()
atexit.register(_zygote.close)


def warm_zygote() -> None:
    """Start this process's zygote before forking workers that run sandbox jobs: they share
    it, instead of each starting its own (about 45 ms of CPU)."""
    _zygote.warm()


def spawn_job(*, cwd: Path, env: dict[str, str], spec: IO[str], channel: IO[str], out: IO[str],
              err: IO[str]) -> SandboxProcess:
    """Start `sandbox_child.main(spec, channel)` in a fresh session, as described above."""
    return _zygote.spawn({"cwd": str(cwd), "env": env},
                         [f.fileno() for f in (spec, channel, out, err)])
