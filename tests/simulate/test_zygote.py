"""Jobs forked from the zygote behave as the fresh interpreters they replace."""

from __future__ import annotations

import os

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
