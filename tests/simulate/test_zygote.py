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
