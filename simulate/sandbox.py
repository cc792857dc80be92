"""Run untrusted candidate code and its tests in a contained child process.

`run_sandboxed(job) -> result` is a pure function of JSON-serializable pydantic types, so a
Celery task can wrap it unchanged on another machine; `run_sandboxed_many` runs a batch on a
small thread pool (each thread only waits on its child) because RL scores many rollouts at once.

Containment, in layers (each applied where the OS permits; `SandboxResult.isolation` says which):
- a private temp dir as cwd and HOME, an environment holding only PATH, HOME and LANG;
- rlimits: CPU seconds, address space, file size, process count;
- as root, a fresh random unprivileged uid per job: RLIMIT_NPROC is not enforced for root, and
  the uid makes the parent's files and /proc/<pid>/environ unreadable; at the end every process
  of that uid is killed, including ones that left the process group;
- a fresh network namespace (`unshare(CLONE_NEWNET)`, or inside a user namespace when not root);
- an audit hook refusing sockets, process spawning, ctypes and writes outside the workspace,
  which reports each attempt as a violation (it is a tripwire, the layers above are the wall);
- a wall-clock timeout that kills the whole process group.

Each job is forked from a warm interpreter (`simulate.zygote`) rather than started fresh.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Literal

from pydantic import BaseModel, Field, ValidationError

from simulate.zygote import SandboxProcess, spawn_job

Status = Literal["passed", "failed", "error", "timed_out", "resource_limit"]
Limit = Literal["cpu", "memory", "file_size", "processes", "wall"]
_UID_RANGE = (1_000_000, 2_000_000_000)  # far above any account, so a fresh uid owns nothing


class SandboxLimits(BaseModel):
    cpu_seconds: int = Field(default=10, ge=1)
    wall_seconds: float = Field(default=20.0, gt=0)
    memory_mb: int = Field(default=512, ge=64)
    file_size_mb: int = Field(default=16, ge=1)
    max_processes: int = Field(default=16, ge=1)
    output_chars: int = Field(default=2000, ge=0)


class SandboxPolicy(BaseModel):
    audit_hook: bool = True
    allow_processes: bool = False


class SandboxJob(BaseModel):
    """Candidate `code` and `tests` are exec'd in one namespace; `files` are written to the cwd.
    With `command`, the job is that shell command instead (`/bin/sh -c`, in the cwd holding
    `files`), run behind the same walls (network namespace, rlimits, the job's own uid, the
    wall timeout) but without the audit hook, which a new program does not carry; its exit
    code decides the status (0: passed). What it writes stays in the job's temp dir."""

    code: str = ""
    tests: str = ""
    command: str | None = Field(default=None, min_length=1)
    entry_point: str | None = None
    files: dict[str, str] = Field(default_factory=dict)
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    policy: SandboxPolicy = Field(default_factory=SandboxPolicy)


class SandboxResult(BaseModel):
    status: Status
    tests_passed: int | None = None
    tests_total: int | None = None
    stdout_tail: str = ""
    stderr_tail: str = ""
    duration_s: float
    limit_hit: Limit | None = None
    violations: list[str] = Field(default_factory=list)
    isolation: list[str] = Field(default_factory=list)
    failures: list[str] = Field(default_factory=list)
    exit_code: int | None = None
    uid: int | None = None  # the job's own uid when run as root, for auditing


def run_sandboxed_many(jobs: Sequence[SandboxJob], *, max_workers: int = 4) -> list[SandboxResult]:
    """Run jobs concurrently; results come back in the order of `jobs`."""
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        return list(pool.map(run_sandboxed, jobs))


def run_sandboxed(job: SandboxJob) -> SandboxResult:
    """Run one job to completion or to its wall timeout; never raises on anything the code does."""
    uid = secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0]) + _UID_RANGE[0] \
        if os.geteuid() == 0 else None
    workspace = Path(tempfile.mkdtemp(prefix="flywheel-sandbox-"))
    try:
        _write_files(workspace, job.files, uid)
        return _supervise(job, workspace, uid)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)


def _write_files(workspace: Path, files: dict[str, str], uid: int | None) -> None:
    for relative, content in files.items():
        target = (workspace / relative).resolve()
        if not target.is_relative_to(workspace.resolve()):
            raise ValueError(f"file path escapes the workspace: {relative}")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
    if uid is not None:
        for path in [workspace, *workspace.rglob("*")]:
            os.chown(path, uid, uid)


def _supervise(job: SandboxJob, workspace: Path, uid: int | None) -> SandboxResult:
    spec = {"workspace": str(workspace), "uid": uid, "code": job.code, "tests": job.tests,
            "command": job.command, "entry_point": job.entry_point,
            "limits": job.limits.model_dump(), "policy": job.policy.model_dump()}
    with tempfile.TemporaryFile("w+") as spec_file, tempfile.TemporaryFile("w+") as channel, \
            tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        json.dump(spec, spec_file)
        spec_file.seek(0)
        env = {"PATH": os.defpath, "HOME": str(workspace), "LANG": "C.UTF-8"}
        start = time.monotonic()
        child = spawn_job(cwd=workspace, env=env, spec=spec_file, channel=channel, out=out,
                          err=err)
        timed_out = not child.wait_exit(job.limits.wall_seconds)
        survivors = _kill_everything(child, uid)
        duration = time.monotonic() - start
        result = _judge(_parse_records(_read(channel)), child.returncode, timed_out, survivors,
                        job.limits, duration=duration, uid=uid, command=job.command is not None)
        tail = job.limits.output_chars
        result.stdout_tail = _read(out)[-tail:] if tail else ""
        result.stderr_tail = _read(err)[-tail:] if tail else ""
        return result


class _Report(BaseModel):
    passed: int
    total: int | None


class _ChildRecord(BaseModel):
    """One JSON line from the child, one field set. Untrusted: the code could forge it."""

    isolation: list[str] | None = None
    violation: str | None = None
    limit: Limit | None = None
    failure: str | None = None
    error: str = ""
    report: _Report | None = None


def _parse_records(text: str) -> list[_ChildRecord]:
    records = []
    for line in text.splitlines():
        try:
            records.append(_ChildRecord.model_validate_json(line))
        except ValidationError:
            continue  # garbage the candidate wrote to the channel
    return records


def _judge(records: list[_ChildRecord], returncode: int | None, timed_out: bool, survivors: int,
           limits: SandboxLimits, *, duration: float, uid: int | None,
           command: bool = False) -> SandboxResult:
    """Fold the child's records and its exit into one status; the worst outcome wins. A
    command job reports no tests: its exit code is its verdict."""
    report = next((r.report for r in reversed(records) if r.report), None)
    if command:
        report = _Report(passed=int(returncode == 0), total=1) if returncode is not None \
            else None
    limit = next((r.limit for r in records if r.limit), None)
    if returncode == -signal.SIGXCPU:
        limit = "cpu"
    if survivors >= limits.max_processes:
        limit = "processes"
    if timed_out:
        status: Status = "timed_out"
        limit = limit or "wall"
    elif limit is not None:
        status = "resource_limit"
    elif report is None or report.total is None:
        status = "error"
    else:
        status = "passed" if report.passed == report.total else "failed"
    return SandboxResult(
        status=status, duration_s=round(duration, 4), limit_hit=limit, exit_code=returncode,
        tests_passed=report.passed if report else None,
        tests_total=report.total if report else None, uid=uid,
        violations=[r.violation for r in records if r.violation],
        isolation=next((r.isolation for r in records if r.isolation is not None), []),
        failures=[f"{r.failure}: {r.error}" for r in records if r.failure])


def _kill_everything(child: SandboxProcess, uid: int | None) -> int:
    """Kill the process group and, when the job has its own uid, every process of that uid.

    Returns how many processes were alive first, a lower bound on how far a fork bomb got.
    SIGKILL is delivered asynchronously, so we re-kill until none is left running.
    """
    survivors = _count_uid(uid) if uid is not None else 0
    child.kill_group()
    if uid is None or survivors == 0:
        return survivors  # no process of the uid is left that could fork another
    for _ in range(200):
        _kill_uid(uid)
        if _count_uid(uid) == 0:
            break
        time.sleep(0.005)
    return survivors


def _count_uid(uid: int) -> int:
    """Running processes of `uid` (zombies excluded: they are dead, awaiting their reaper)."""
    count = 0
    for pid in os.listdir("/proc"):
        try:  # /proc/<pid> belongs to the process's uid: read the state of those only
            if not pid.isdigit() or os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            fields = dict(line.split(":", 1)
                          for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        except (OSError, ValueError):
            continue  # exited while we looked
        alive = fields.get("State", "Z").split()[0] not in ("Z", "X")
        count += alive and fields.get("Uid", "").split()[:1] == [str(uid)]
    return count


def _kill_uid(uid: int) -> None:
    """kill(-1) from a helper that has become `uid` reaches exactly that uid's processes.

    The kernel sends it under the task-list lock, so a fork bomb cannot outrun it.
    """
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(uid)
            os.setuid(uid)
            if os.getuid() == uid and os.geteuid() == uid:  # never kill(-1) as root
                os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _read(file: IO[str]) -> str:
    file.seek(0)
    return file.read()
