"""Jobs forked from the zygote behave as the fresh interpreters they replace."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path

from simulate import zygote
from simulate.sandbox import SandboxJob, SandboxPolicy, run_sandboxed

NO_HOOK = SandboxPolicy(audit_hook=False)
PASSING = "def test_ok():\n    assert True\n"


def test_job_runs_in_its_own_session_and_workspace() -> None:
    code = ("import os, sys\n"
            "print(os.getsid(0) == os.getpid(), os.getcwd().startswith('/tmp'),"
            " sys.flags.no_site, sorted(os.environ))\n")
    result = run_sandboxed(SandboxJob(code=code, tests=PASSING))
    assert result.status == "passed"
    assert result.stdout_tail.strip() == "True True 1 ['HOME', 'LANG', 'PATH']"


def test_exit_code_is_reported_like_a_child_process() -> None:
    result = run_sandboxed(SandboxJob(code="import os\nos._exit(3)\n", tests=PASSING))
    assert (result.status, result.exit_code) == ("error", 3)


def test_installed_packages_stay_importable_without_site() -> None:
    result = run_sandboxed(SandboxJob(code="import tqdm\nprint(tqdm.__name__)\n",
                                      tests=PASSING, policy=NO_HOOK))
    assert result.status == "passed" and result.stdout_tail.strip() == "tqdm"


def test_a_killed_zygote_is_restarted_for_the_next_job() -> None:
    assert run_sandboxed(SandboxJob(code="", tests=PASSING)).status == "passed"
    process = zygote._zygote._process
    assert process is not None
    process.kill()
    process.wait()
    assert run_sandboxed(SandboxJob(code="", tests=PASSING)).status == "passed"
    assert zygote._zygote._process is not process and zygote._zygote._owner == os.getpid()


def test_a_killed_reaper_still_ends_with_the_job_group_killed(tmp_path: Path) -> None:
    """A job running as our own uid (no root) could kill its reaper; the supervisor then
    kills the job's group itself and reports no exit code."""
    spec = {"workspace": str(tmp_path), "uid": None, "code": "import time\ntime.sleep(60)\n",
            "tests": PASSING, "entry_point": None, "policy": NO_HOOK.model_dump(),
            "limits": {"cpu_seconds": 10, "memory_mb": 512, "file_size_mb": 16,
                       "max_processes": 16}}
    files = [tempfile.TemporaryFile("w+") for _ in range(4)]
    json.dump(spec, files[0])
    files[0].seek(0)
    process = zygote.spawn_job(cwd=tmp_path, env={"PATH": os.defpath}, spec=files[0],
                               channel=files[1], out=files[2], err=files[3])
    reaper = int(Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(reaper, signal.SIGKILL)
    assert process.wait_exit(timeout=10)  # the reaper's end wakes the supervisor
    assert process.kill_group() is None
    for _ in range(200):  # SIGKILL is asynchronous
        if not Path(f"/proc/{process.pid}").exists() or \
                " Z " in Path(f"/proc/{process.pid}/stat").read_text():
            break
        time.sleep(0.01)
    else:
        raise AssertionError("the job outlived its group's kill")
    for f in files:
        f.close()


def _zygotes_of(pid: int) -> int:
    """Zygote processes whose parent is `pid`."""
    found = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        found += parent == pid and b"--zygote" in cmdline
    return found


def test_a_fork_runs_its_jobs_on_the_zygote_its_parent_warmed() -> None:
    """An agent episode forked from its warm host (simulate/agent_host.py) uses the host's
    zygote instead of starting one of its own."""
    zygote.warm_zygote()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the fork: one job, then how many zygotes it started
        os.close(read)
        result = run_sandboxed(SandboxJob(code="def f(x):\n    return x + 1\n",
                                          tests="def test_0():\n    assert f(1) == 2\n",
                                          entry_point="f"))
        os.write(write, json.dumps([result.status, _zygotes_of(os.getpid())]).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        status, started = json.loads(answer.read())
    os.waitpid(pid, 0)
    assert (status, started) == ("passed", 0)
