"""The child side of `simulate.sandbox`: isolate this process, then run candidate code and tests.

Run by `simulate.zygote` as `python -I -B -S sandbox_child.py --zygote CONTROL_FD [SITE_DIR…]`:
a zygote that imports this module once and forks a job child per request (an interpreter start
and these imports cost ~35 ms of CPU per job; a fork ~1 ms). It imports nothing but the
standard library (pydantic alone would add ~0.25 s), and never runs candidate code itself.
`python -I -B sandbox_child.py SPEC_FD RESULT_FD` runs one job directly.

Order matters: leave the network namespace and pre-import the modules the code names while
still privileged, then set rlimits, drop to the job's unprivileged uid, and install the audit
hook last so that nothing the runner itself does is refused. Every violation and limit is
written to RESULT_FD as one JSON line the moment it happens, so a crash cannot erase it; the
last line is the test report.
"""

from __future__ import annotations

import ast
import ctypes
import errno
import importlib
import json
import os
import resource
import select
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any, TextIO

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
_SPAWN_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                 "os.fork", "os.forkpty", "pty.spawn", "os.kill", "os.killpg")
_PATH_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                "os.symlink", "os.link", "os.truncate", "os.utime", "shutil.rmtree")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def emit(channel: TextIO, record: dict[str, Any]) -> None:
    """Write one JSON line to the result channel and flush, so the parent sees it even on a kill."""
    channel.write(json.dumps(record) + "\n")
    channel.flush()


def leave_network() -> str | None:
    """Enter a fresh network namespace (only a downed loopback); return how, or None if refused."""
    libc = ctypes.CDLL(None, use_errno=True)
    if os.geteuid() == 0 and libc.unshare(CLONE_NEWNET) == 0:
        return "netns"
    # Unprivileged: a user namespace grants the right to create a network namespace.
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        return "userns+netns"
    return None


def preimport(sources: list[str], workspace: str) -> None:
    """Import the modules the code names while the interpreter's files are still readable.

    After the uid drop the interpreter's own directory may be unreadable (e.g. under /root).
    Names that exist in the workspace are skipped: they are the candidate's and must not run
    with privileges.
    """
    local = {name.split(".")[0] for name in os.listdir(workspace)}
    names = {"traceback", "linecache", "encodings.idna"}
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
    for name in sorted(names):
        if name.split(".")[0] not in local:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a missing module fails later, inside the job
                continue


def set_limits(limits: dict[str, Any]) -> None:
    """CPU seconds, address space, file size and process count, each with a hard cap."""
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_seconds"], limits["cpu_seconds"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_size_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def drop_privileges(uid: int) -> None:
    """Become `uid` with no supplementary groups; RLIMIT_NPROC is ignored for root."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _inside(path: str, root: str) -> bool:
    return os.path.realpath(path).startswith(root + os.sep)


def audit_hook(workspace: str, policy: dict[str, Any], report: Callable[[str], None]):
    """Refuse network, process spawning, native code and writes outside the workspace."""

    def hook(event: str, args: tuple[Any, ...]) -> None:
        reason = None
        if event.startswith("socket."):
            reason = f"network: {event}"
        elif event in _SPAWN_EVENTS and not policy["allow_processes"]:
            reason = f"process: {event}"
        elif event.startswith("ctypes."):
            reason = f"native: {event}"
        elif event == "open" and isinstance(args[0], (str, bytes)):
            path = os.fsdecode(args[0])
            mode, flags = args[1] or "", args[2] or 0
            writes = any(c in mode for c in "wax+") or bool(flags & _WRITE_FLAGS)
            if path.startswith("/proc/") and path.endswith("environ"):
                reason = f"environment: read {path}"
            elif writes and not _inside(path, workspace):
                reason = f"filesystem: write {path}"
        elif event in _PATH_EVENTS and isinstance(args[0], (str, bytes)):
            if not _inside(os.fsdecode(args[0]), workspace):
                reason = f"filesystem: {event} {os.fsdecode(args[0])}"
        if reason is not None:
            report(reason)
            raise PermissionError(f"sandbox: {reason}")

    return hook


def limit_of(exc: BaseException) -> str | None:
    """Name the resource limit an exception signals, if any."""
    if isinstance(exc, MemoryError):
        return "memory"
    if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
        return "file_size"
    if isinstance(exc, BlockingIOError) or (isinstance(exc, OSError) and exc.errno == errno.EAGAIN):
        return "processes"
    return None


def run_tests(spec: dict[str, Any], channel: TextIO) -> dict[str, Any]:
    """Exec the candidate, then the tests, in one namespace (as HumanEval does); count passes.

    Tests are top-level `test_*` functions when there are any, else HumanEval's `check(f)`,
    else the test module itself counts as one test.
    """
    namespace: dict[str, Any] = {"__name__": "__main__"}

    def attempt(fn: Callable[[], object], phase: str) -> bool:
        try:
            fn()
            return True
        except BaseException as exc:  # noqa: BLE001 - the candidate may raise anything
            if (limit := limit_of(exc)) is not None:
                emit(channel, {"limit": limit})
            emit(channel, {"failure": phase, "error": "".join(
                traceback.format_exception_only(type(exc), exc)).strip()[-500:]})
            return False

    if not attempt(lambda: exec(compile(spec["code"], "solution.py", "exec"), namespace),
                   "code"):
        return {"phase": "code", "passed": 0, "total": None}
    try:
        tree = ast.parse(spec["tests"])
    except SyntaxError:
        return {"phase": "tests", "passed": 0, "total": None}
    tests = [n.name for n in tree.body
             if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
    loaded = attempt(lambda: exec(compile(tree, "tests.py", "exec"), namespace), "tests")
    if not tests:
        entry = spec.get("entry_point")
        if not (loaded and entry and "check" in namespace):
            return {"phase": "done", "passed": int(loaded), "total": 1}
        return {"phase": "done", "total": 1,
                "passed": int(attempt(lambda: namespace["check"](namespace[entry]), "check"))}
    if not loaded:
        return {"phase": "tests", "passed": 0, "total": len(tests)}
    passed = sum(attempt(namespace[name], name) for name in tests)
    return {"phase": "done", "passed": passed, "total": len(tests)}


def main(spec_fd: int, result_fd: int) -> None:
    with os.fdopen(spec_fd) as spec_file:
        spec = json.load(spec_file)
    channel = os.fdopen(result_fd, "w")
    workspace = os.path.realpath(spec["workspace"])
    os.chdir(workspace)
    isolation = [how] if (how := leave_network()) else []
    command = spec.get("command")
    if command is None:
        preimport([spec["code"], spec["tests"]], workspace)
    set_limits(spec["limits"])
    if spec["uid"] is not None:
        drop_privileges(spec["uid"])
        isolation.append("uid")
    if command is not None:  # a shell command: the walls above hold it
        emit(channel, {"isolation": isolation})
        channel.close()
        sys.stdout.flush()
        os.execv("/bin/sh", ["sh", "-c", command])
    sys.path.insert(0, workspace)
    if spec["policy"]["audit_hook"]:
        sys.addaudithook(audit_hook(workspace, spec["policy"],
                                    lambda reason: emit(channel, {"violation": reason})))
        isolation.append("audit_hook")
    emit(channel, {"isolation": isolation})
    emit(channel, {"report": run_tests(spec, channel)})
    channel.close()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: candidate atexit hooks and __del__ must not run


def zygote(control: socket.socket) -> None:
    """Serve job requests until the supervisor closes `control`.

    A request is one SEQPACKET message, `{"cwd": …, "env": {…}}`, carrying five descriptors:
    spec, result channel, stdout, stderr, and the reply socket of that job. For each, fork a
    reaper, which forks the job and then speaks for it on the reply socket, as `Popen` would
    for its parent: `pid N`, `exited` when the job ends (its zombie still pins the pid and
    process group), then on `kill` it kills the job's group, reaps it and sends `status N`
    (the `Popen.returncode` convention).
    """
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # reapers are reaped by the kernel
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the supervisor's to handle
    while True:
        message, fds, _, _ = socket.recv_fds(control, 65536, 5)
        if not message:
            return
        if os.fork() == 0:
            control.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                reap(json.loads(message), *fds)
            except BaseException:  # noqa: BLE001 - on the zygote's stderr; the reply closes
                traceback.print_exc()
            finally:
                os._exit(0)
        for fd in fds:
            os.close(fd)


def reap(request: dict[str, Any], spec_fd: int, result_fd: int, out_fd: int, err_fd: int,
         reply_fd: int) -> None:
    reply = socket.socket(fileno=reply_fd)
    job = os.fork()
    if job == 0:
        become_job(request, spec_fd, result_fd, out_fd, err_fd)
    for fd in (spec_fd, result_fd, out_fd, err_fd):
        os.close(fd)
    pidfd = os.pidfd_open(job)
    reply.send(f"pid {job}".encode())
    waiting: list[int | socket.socket] = [pidfd, reply]
    while True:
        readable, _, _ = select.select(waiting, [], [])
        if pidfd in readable:
            reply.send(b"exited")
            waiting.remove(pidfd)
        if reply in readable and reply.recv(64) in (b"kill", b""):  # b"": supervisor gone
            try:
                os.killpg(job, signal.SIGKILL)
            except ProcessLookupError:
                pass  # the group is already gone
            _, status = os.waitpid(job, 0)
            reply.send(f"status {os.waitstatus_to_exitcode(status)}".encode())
            return


def become_job(request: dict[str, Any], spec_fd: int, result_fd: int, out_fd: int,
               err_fd: int) -> None:
    """What `Popen(start_new_session=True, cwd=…, env=…, pass_fds=…)` did, then `main`."""
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        devnull = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((devnull, 0), (out_fd, 1), (err_fd, 2)):
            os.dup2(fd, target)
        keep = {0, 1, 2, spec_fd, result_fd}
        for fd in map(int, os.listdir("/proc/self/fd")):
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass  # the directory listing's own descriptor
        main(spec_fd, result_fd)  # ends in os._exit(0)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported on the job's stderr, as a crash would be
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "--zygote":
        sys.path.extend(sys.argv[3:])  # site-packages, without running their .pth hooks
        zygote(socket.socket(fileno=int(sys.argv[2])))
    else:
        main(int(sys.argv[1]), int(sys.argv[2]))
