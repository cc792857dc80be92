"""A warm host for an agent program's entry point: imported once, each episode a fork of it.

Starting an agent program per episode costs its interpreter and imports every time (about
0.7 s of CPU for the built-in agent, 1.6 s for one on the OpenAI Agents SDK), more than the
episode's own work on a small model. An agent given as an entry point (`AgentProgram.
entry_point`: `package.module:function` or `path/to/file.py:function`) is imported once by
this host, and each episode is a child forked from it, still a process of its own:

    python -m simulate.agent_host ENTRY_POINT
    stdin  <- {"episode": "s1", "env": {...}, "cwd": "/ws", "output": "/ws.log",
               "memory_mb": 4096, "cpu_seconds": 300}
    stdout -> {"episode": "s1", "pid": 1234}      once forked
    stdout -> {"episode": "s1", "code": 0}        when it ended (negative: killed by a signal)

The child starts a session of its own (its process group, which the worker kills whole at the
deadline), takes the contract's environment in place of the host's, its working directory
and rlimits, sends its output to the `output` file, calls the function (awaiting it when it
returns a coroutine) and exits 0, or with the int the function returned, or 1 with the
traceback in its output when it raised. The host itself runs no thread and no event loop, so
that a fork is a clean copy of it. It exits when its stdin closes (the worker went away),
killing the episodes still running.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import importlib.util
import inspect
import json
import os
import resource
import select
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def load_entry_point(entry_point: str) -> Callable[[], Any]:
    """The function `module:function` or `file.py:function` names."""
    target, _, name = entry_point.rpartition(":")
    if not target or not name:
        raise ValueError(f"entry point {entry_point!r}: want MODULE:FUNCTION or FILE.py:FUNCTION")
    if target.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(target).stem, target)
        if spec is None or spec.loader is None:
            raise ValueError(f"entry point {entry_point!r}: cannot load {target}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    function = getattr(module, name)
    if not callable(function):
        raise ValueError(f"entry point {entry_point!r}: {name} is not callable")
    return function  # type: ignore[no-any-return]


def set_walls(memory_mb: int, cpu_seconds: int) -> None:
    """An agent episode's rlimits (`AgentProgram.memory_mb`, `cpu_seconds`), in its process:
    here for a forked episode, and before exec for a command's."""
    memory = memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))


def run_child(function: Callable[[], Any], request: dict[str, Any], answers: int) -> None:
    """In the forked child: become the episode, run it, and never return. It keeps no end of
    the host's pipes (`answers`: where the host reports)."""
    code = 1
    try:
        os.close(answers)
        os.setsid()
        out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        set_walls(int(request["memory_mb"]), int(request["cpu_seconds"]))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        result = function()
        if inspect.iscoroutine(result):
            result = asyncio.run(result)
        code = result if isinstance(result, int) and not isinstance(result, bool) else 0
    except BaseException:  # noqa: BLE001 - whatever the agent raised ends its episode
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(function: Callable[[], Any], answers: int) -> None:
    """Fork an episode per request line on stdin; report pids and exit codes on the file
    descriptor `answers`."""
    running: dict[int, str] = {}  # pid -> episode

    def say(message: dict[str, Any]) -> None:
        os.write(answers, (json.dumps(message) + "\n").encode())

    pending = b""
    stdin = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.02)
        if ready:
            chunk = os.read(stdin, 65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    run_child(function, request, answers)
                running[pid] = request["episode"]
                say({"episode": request["episode"], "pid": pid})
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            say({"episode": running.pop(pid), "code": os.waitstatus_to_exitcode(status)})
    for pid in running:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main(argv: list[str]) -> int:
    # the answers go to the real stdout; whatever the agent's module prints (at import, or
    # an episode before it redirects its own) goes to stderr, the worker's log
    answers = os.dup(1)
    os.dup2(2, 1)
    function = load_entry_point(argv[0])
    # what the host holds now stays out of the children's garbage collections: a collection
    # that walks it would write to every page of it and copy it all into each fork
    gc.collect()
    gc.freeze()
    serve(function, answers)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
