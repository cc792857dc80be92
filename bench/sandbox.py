"""Cost of one sandbox job: forked from the zygote against a fresh interpreter per job.

Both run the same small job (a function and three tests) through `sandbox_child.main`. The
zygote path is `run_sandboxed` as GRPO calls it (workspace, supervision, uid cleanup
included); the baseline starts `python -I -B sandbox_child.py SPEC RESULT` per job, as
`run_sandboxed` did before the zygote, with only the child's spec and result channel around
it. CPU is the whole machine's busy time (/proc/stat) per job, because the zygote's jobs are not
this process's children; run it on an otherwise idle machine.

    .venv/bin/python bench/sandbox.py [--jobs 200]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulate.sandbox import SandboxJob, run_sandboxed  # noqa: E402

CHILD = Path(__file__).resolve().parents[1] / "simulate" / "sandbox_child.py"
JOB = SandboxJob(code="def f(x):\n    return x + 1\n", entry_point="f",
                 tests="def test_one():\n    assert f(1) == 2\n\n"
                       "def test_zero():\n    assert f(0) == 1\n\n"
                       "def test_neg():\n    assert f(-5) == -4\n")


def machine_busy_s() -> float:
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait


def fresh_interpreter() -> None:
    """The job through a fresh `python -I -B sandbox_child.py` (the pre-zygote launch)."""
    workspace = tempfile.mkdtemp(prefix="flywheel-bench-")
    spec = {"workspace": workspace, "uid": None, "code": JOB.code, "tests": JOB.tests,
            "entry_point": JOB.entry_point, "limits": JOB.limits.model_dump(),
            "policy": JOB.policy.model_dump()}
    with tempfile.TemporaryFile("w+") as spec_file, tempfile.TemporaryFile("w+") as channel:
        json.dump(spec, spec_file)
        spec_file.seek(0)
        subprocess.run([sys.executable, "-I", "-B", str(CHILD), str(spec_file.fileno()),
                        str(channel.fileno())], cwd=workspace, check=True,
                       pass_fds=(spec_file.fileno(), channel.fileno()),
                       env={"PATH": os.defpath, "HOME": workspace, "LANG": "C.UTF-8"},
                       stdout=subprocess.DEVNULL, start_new_session=True)
        channel.seek(0)
        if '"passed": 3' not in channel.read():
            raise RuntimeError("the baseline job did not pass")
    os.rmdir(workspace)


def zygote() -> None:
    if run_sandboxed(JOB).status != "passed":
        raise RuntimeError("the zygote job did not pass")


def measure(run: Callable[[], None], jobs: int) -> tuple[float, float]:
    """(wall ms, machine CPU ms) per job, after one warm-up job."""
    run()
    busy, start = machine_busy_s(), time.perf_counter()
    for _ in range(jobs):
        run()
    return ((time.perf_counter() - start) / jobs * 1e3, (machine_busy_s() - busy) / jobs * 1e3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=200)
    args = parser.parse_args(argv)
    fresh_wall, fresh_cpu = measure(fresh_interpreter, args.jobs)
    zygote_wall, zygote_cpu = measure(zygote, args.jobs)
    print(f"fresh interpreter: {fresh_wall:6.1f} ms wall, {fresh_cpu:6.1f} ms CPU per job")
    print(f"zygote fork:       {zygote_wall:6.1f} ms wall, {zygote_cpu:6.1f} ms CPU per job")
    # the machine's CPU counters tick every 10 ms: a few fast jobs can read as 0 CPU
    ratio = round(fresh_cpu / zygote_cpu, 2) if zygote_cpu > 0 else None
    print(f"CPU per job: {ratio}x less" if ratio else "CPU per job: below the counters' tick")
    print(json.dumps({"bench": "sandbox", "jobs": args.jobs,
                      "fresh_wall_ms": round(fresh_wall, 2), "fresh_cpu_ms": round(fresh_cpu, 2),
                      "zygote_wall_ms": round(zygote_wall, 2),
                      "zygote_cpu_ms": round(zygote_cpu, 2),
                      "cpu_ratio": ratio}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
