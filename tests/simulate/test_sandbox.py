"""The sandbox runs real child processes; each containment layer is attacked for real."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from simulate.sandbox import (
    SandboxJob,
    SandboxLimits,
    SandboxPolicy,
    SandboxResult,
    run_sandboxed,
    run_sandboxed_many,
)

ADD_ONE_TESTS = """
def test_one():
    assert f(1) == 2

def test_zero():
    assert f(0) == 1

def test_negative():
    assert f(-5) == -4
"""
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the per-job uid needs root")
NO_HOOK = SandboxPolicy(audit_hook=False)


def run(code: str, tests: str = ADD_ONE_TESTS, **fields) -> SandboxResult:
    return run_sandboxed(SandboxJob(code=code, tests=tests, **fields))


def uid_processes(uid: int) -> list[str]:
    """Lines of `ps` for the running (not zombie) processes of `uid`."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        if f"\nUid:\t{uid}\t" in text and "State:\tZ" not in text:
            found.append(status.parent.name)
    return found


def test_correct_code_passes_every_test() -> None:
    result = run("def f(x):\n    return x + 1\n")
    assert (result.status, result.tests_passed, result.tests_total) == ("passed", 3, 3)


def test_partly_wrong_code_counts_the_tests_it_passes() -> None:
    result = run("def f(x):\n    return abs(x) + 1\n")
    assert (result.status, result.tests_passed, result.tests_total) == ("failed", 2, 3)
    assert result.failures == ["test_negative: AssertionError"]


def test_code_that_does_not_compile_is_an_error() -> None:
    result = run("def f(x) return x\n")
    assert result.status == "error"
    assert "SyntaxError" in result.failures[0]


def test_humaneval_style_check_is_one_test() -> None:
    tests = "def check(candidate):\n    assert candidate('ab') == 'ba'\n"
    good = run("def rev(s):\n    return s[::-1]\n", tests, entry_point="rev")
    bad = run("def rev(s):\n    return s\n", tests, entry_point="rev")
    assert (good.status, good.tests_total, bad.status, bad.tests_passed) == (
        "passed", 1, "failed", 0)


def test_repo_files_are_importable_and_output_is_captured() -> None:
    result = run("from mathlib import f\nprint('hello from the job')\n",
                 files={"mathlib/__init__.py": "def f(x):\n    return x + 1\n"})
    assert result.status == "passed"
    assert result.stdout_tail == "hello from the job\n"


def test_network_is_unreachable_even_without_the_audit_hook() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
    contained = run(code, "", policy=NO_HOOK)
    reported = run(code, "")
    server.setblocking(False)
    with pytest.raises(BlockingIOError):  # nothing ever reached the listening socket
        server.accept()
    server.close()
    if not any("netns" in layer for layer in contained.isolation):
        pytest.skip("this kernel refuses network namespaces; only the audit hook applies")
    assert contained.status == "error"
    assert "OSError" in contained.failures[0]  # ENETUNREACH: the namespace has no route
    assert reported.violations[0].startswith("network: socket.")


@as_root
def test_fork_bomb_is_capped_and_every_process_is_killed() -> None:
    # every child keeps forking and ignores the EAGAIN that RLIMIT_NPROC returns
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        0\n"
    limits = SandboxLimits(wall_seconds=2, max_processes=8)
    result = run(bomb, "", limits=limits, policy=SandboxPolicy(allow_processes=True))
    assert (result.status, result.limit_hit) == ("timed_out", "processes")
    assert result.uid is not None and uid_processes(result.uid) == []


def test_fork_is_refused_and_reported_by_default() -> None:
    result = run("import os\nos.fork()\n", "")
    assert result.status == "error"
    assert result.violations == ["process: os.fork"]


def test_memory_bomb_hits_the_memory_limit() -> None:
    result = run("blob = bytearray(4 * 1024 ** 3)\n", "", limits=SandboxLimits(memory_mb=256))
    assert (result.status, result.limit_hit) == ("resource_limit", "memory")


def test_cpu_spin_is_killed_by_the_cpu_limit() -> None:
    result = run("while True:\n    pass\n", "", limits=SandboxLimits(cpu_seconds=1))
    assert (result.status, result.limit_hit) == ("resource_limit", "cpu")


def test_sleeping_forever_hits_the_wall_timeout() -> None:
    result = run("import time\ntime.sleep(30)\n", "", limits=SandboxLimits(wall_seconds=1))
    assert (result.status, result.limit_hit) == ("timed_out", "wall")
    assert result.duration_s < 5


def test_huge_file_hits_the_file_size_limit() -> None:
    code = "with open('big.bin', 'wb') as f:\n    f.write(b'x' * (3 * 1024 * 1024))\n"
    result = run(code, "", limits=SandboxLimits(file_size_mb=1))
    assert (result.status, result.limit_hit) == ("resource_limit", "file_size")


def test_writing_outside_the_workspace_is_refused_and_reported(tmp_path: Path) -> None:
    target = tmp_path / "escaped.txt"
    result = run(f"open({str(target)!r}, 'w').write('pwned')\n", "")
    assert not target.exists()
    assert result.violations == [f"filesystem: write {target}"]


@as_root
def test_writing_outside_is_denied_by_the_os_without_the_hook(tmp_path: Path) -> None:
    target = tmp_path / "escaped.txt"
    result = run(f"open({str(target)!r}, 'w').write('pwned')\n", "", policy=NO_HOOK)
    assert not target.exists()
    assert "PermissionError" in result.failures[0]


@pytest.mark.parametrize("policy", [SandboxPolicy(), pytest.param(NO_HOOK, marks=as_root)],
                         ids=["hook", "no_hook"])
def test_parent_environment_is_not_visible(monkeypatch, policy: SandboxPolicy) -> None:
    monkeypatch.setenv("FLYWHEEL_SANDBOX_SECRET", "hunter2")
    code = ("import os\nprint(dict(os.environ))\n"
            "print(open(f'/proc/{os.getppid()}/environ').read())\n")
    result = run(code, "", policy=policy)
    assert "hunter2" not in result.stdout_tail
    assert result.stdout_tail.startswith("{'PATH'")
    assert result.status == "error"  # reading the parent's environ raised
    if policy.audit_hook:
        assert result.violations[0].startswith("environment: read /proc/")


def test_pool_returns_results_in_job_order() -> None:
    jobs = [SandboxJob(code=f"def f(x):\n    return x + {k}\n", tests=ADD_ONE_TESTS)
            for k in (1, 2, 1, 0)]
    statuses = [r.status for r in run_sandboxed_many(jobs, max_workers=2)]
    assert statuses == ["passed", "failed", "passed", "failed"]


def test_jobs_and_results_survive_a_json_round_trip() -> None:
    job = SandboxJob(code="def f(x):\n    return x + 1\n", tests=ADD_ONE_TESTS,
                     files={"data/a.txt": "1"})
    result = run_sandboxed(SandboxJob.model_validate_json(job.model_dump_json()))
    assert SandboxResult.model_validate_json(result.model_dump_json()) == result


def test_file_paths_may_not_escape_the_workspace() -> None:
    with pytest.raises(ValueError, match="escapes the workspace"):
        run("", "", files={"../outside.py": ""})


def test_a_shell_command_runs_behind_the_same_walls(tmp_path: Path, monkeypatch) -> None:
    """A command job (`SandboxJob.command`): its exit code is its verdict; no network, not
    the parent's environment, and (as root, with its own uid) no write outside its dir."""
    monkeypatch.setenv("FLYWHEEL_SANDBOX_SECRET", "hunter2")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    target = tmp_path / "escaped.txt"
    command = (f"cat notes.txt; env; python3 -c \"import socket; "
               f"socket.create_connection(('127.0.0.1', {port}), timeout=2)\"; "
               f"echo pwned > {target}; exit 7")
    result = run_sandboxed(SandboxJob(files={"notes.txt": "hello\n"}, command=command))
    server.setblocking(False)
    with pytest.raises(BlockingIOError):
        server.accept()
    server.close()
    assert (result.status, result.exit_code, result.tests_total) == ("failed", 7, 1)
    assert result.stdout_tail.startswith("hello\n") and "hunter2" not in result.stdout_tail
    if any("netns" in layer for layer in result.isolation):
        assert "Network is unreachable" in result.stderr_tail
    if os.geteuid() == 0:
        assert not target.exists() and "Permission denied" in result.stderr_tail
    assert run_sandboxed(SandboxJob(command="true")).status == "passed"
