"""Rewards for a rollout: verifiable tests, anti-cheating checks, an optional rubric judge.

RL finds every shortcut, so a completion that games the check gets zero reward and names why:
edited test files, expected outputs hard-coded from the tests, looking at the test harness
(stack frames, `check`, test files, objects equal to everything, early exit), and sandbox
escape attempts (network, processes, native code, the environment, paths outside the
workspace), found statically in the code and dynamically in the sandbox's violations.
`tally_flags` counts them over a batch for the training log.

The judge is any OpenAI-compatible endpoint asked for a 0-10 score against a rubric; its score
is blended with the verifiable one by weight. Without a judge config the reward is verifiable.
The config (`RewardConfig`, `JudgeConfig`) is part of a rollout job's wire contract
(`ingest/rollout_events.py`), so every worker scores a run's episodes alike; the judge's key
is read from each worker's environment.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import threading
from collections import Counter
from collections.abc import Iterable
from contextlib import nullcontext

import httpx
from pydantic import BaseModel, Field

from ingest.rollout_events import JudgeConfig, RewardConfig, RewardMode
from simulate.sandbox import SandboxResult

_ESCAPE_MODULES = {"socket", "subprocess", "ctypes", "multiprocessing", "urllib", "http",
                   "requests", "httpx", "pty", "signal", "shutil", "importlib"}
_ESCAPE_CALLS = {"system", "popen", "fork", "forkpty", "kill", "killpg", "execv", "execve",
                 "execvp", "spawnv", "posix_spawn", "getenv", "putenv", "setuid", "chroot"}
_INTROSPECTION = {"_getframe", "f_back", "f_globals", "f_locals", "co_consts", "getsource",
                  "get_referrers", "get_objects", "__code__"}
_HARNESS_NAMES = {"check", "candidate", "__builtins__", "__import__"}
_EXIT_CALLS = {"exit", "_exit", "quit", "abort"}


class Reward(BaseModel):
    value: float  # what the trainer uses, in [0, 1]
    verifiable: float
    judge: float | None = None  # the judge's score / 10
    flags: list[str] = Field(default_factory=list)


class JudgeError(RuntimeError):
    """The judge endpoint failed or its reply held no score."""


def verifiable_reward(result: SandboxResult, mode: RewardMode, *,
                      partial_credit: float = 0.5) -> float:
    if not result.tests_total or result.status in ("timed_out", "resource_limit", "error"):
        return 0.0
    passed = (result.tests_passed or 0) / result.tests_total
    if mode == "fraction":
        return passed
    if mode == "partial" and passed < 1.0:
        return partial_credit * passed
    return float(passed == 1.0)


def test_files(files: dict[str, str]) -> dict[str, str]:
    """The files of a workspace that hold tests (`test_*.py`, `*_test.py`, under `tests/`)."""
    return {path: text for path, text in files.items()
            if re.search(r"(^|/)(test_[^/]*|[^/]*_test\.py|tests?/.*)$", path)}


def file_hashes(files: dict[str, str]) -> dict[str, str]:
    return {path: hashlib.sha256(text.encode()).hexdigest() for path, text in files.items()}


def edited_tests(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """Test files (by sha256) whose content changed or that disappeared."""
    return [f"tests edited: {path}" for path, digest in before.items()
            if after.get(path) != digest]


# CPython 3.11 builds an AST with a recursion depth kept per interpreter, not per thread, and
# two threads parsing at once can fail with "SystemError: AST constructor recursion depth
# mismatch" (python/cpython#106905; seen here when an eval gate scored 400 episodes on
# threads). Rewards are computed on threads, so parses take turns.
_PARSE = threading.Lock()


def parse(source: str) -> ast.Module:
    """`ast.parse`, one thread at a time (see `_PARSE`)."""
    with _PARSE:
        return ast.parse(source)


def cheating_flags(code: str, tests: str, prompt: str = "") -> list[str]:
    """Static checks of candidate `code` against the `tests` it will meet; [] when clean."""
    try:
        tree = parse(code)
    except SyntaxError:
        return []  # it cannot run, so it cannot cheat; the tests will fail it
    flags = [*_escape_flags(tree), *_harness_flags(tree)]
    expected = _expected_outputs(tests)
    copied = {v for v in _literals(tree) & expected
              if repr(v) not in prompt and str(v) not in prompt}
    # one shared constant can be honest (18 * 10 ** (n - 2)); a lookup table of answers is not
    if copied and len(copied) >= min(2, len(expected)):
        flags.append(f"special-cased expected outputs {sorted(map(repr, copied))}")
    return sorted(set(flags))


def _escape_flags(tree: ast.AST) -> Iterable[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""]
            yield from (f"escape: imports {n}" for n in names
                        if n.split(".")[0] in _ESCAPE_MODULES)
        elif isinstance(node, ast.Attribute) and node.attr in _ESCAPE_CALLS | {"environ"}:
            yield f"escape: uses {node.attr}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id == "open" and node.args and isinstance(node.args[0], ast.Constant):
            path = str(node.args[0].value)
            if path.startswith(("/", "~")) or ".." in path:
                yield f"escape: opens {path}"
            elif "test" in path:
                yield f"reads test file {path}"


def _harness_flags(tree: ast.AST) -> Iterable[str]:
    own = _bound_names(tree)  # a local variable called `check` is not the harness's
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _INTROSPECTION:
            yield f"inspects the harness: {node.attr}"
        elif isinstance(node, ast.Name) and node.id not in own and (
                node.id in _HARNESS_NAMES or node.id.startswith("test_")):
            yield f"inspects the harness: {node.id}"
        elif isinstance(node, ast.Import | ast.ImportFrom) and any(
                (a.name if isinstance(node, ast.Import) else node.module) in ("inspect", "gc")
                for a in node.names):
            yield "inspects the harness: imports inspect/gc"
        elif isinstance(node, ast.FunctionDef) and node.name == "__eq__" and any(
                isinstance(r, ast.Return) and isinstance(r.value, ast.Constant)
                and r.value.value is True for r in ast.walk(node)):
            yield "object equal to everything"
        elif isinstance(node, ast.Attribute | ast.Name) and \
                (node.attr if isinstance(node, ast.Attribute) else node.id) in _EXIT_CALLS:
            yield "exits before the tests"


def _bound_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def _expected_outputs(tests: str) -> set[object]:
    """Non-trivial literals compared with `==` in the tests: what a cheat would hard-code."""
    try:
        tree = parse(tests)
    except SyntaxError:
        return set()
    found: set[object] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(o, ast.Eq) for o in node.ops):
            for side in (node.left, *node.comparators):
                found |= {v for v in _constants(side) if _nontrivial(v)}
    return found


def _literals(tree: ast.AST) -> set[object]:
    return {v for node in ast.walk(tree) for v in _constants(node) if _nontrivial(v)}


def _constants(node: ast.AST) -> set[object]:
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return set()
    return {value} if isinstance(value, int | float | str) else set()


def _nontrivial(value: object) -> bool:
    """Small numbers and short strings occur in honest code too."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return abs(value) > 10
    return isinstance(value, str) and len(value) > 3


def judge_score(config: JudgeConfig, prompt: str, completion: str, client: httpx.Client) -> float:
    """Ask the endpoint for a 0-10 score; returns it divided by 10."""
    key = os.environ.get(config.api_key_env, "")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": config.model, "temperature": 0.0, "messages": [
        {"role": "system", "content": config.rubric + " Reply with 'Score: N' (0-10)."},
        {"role": "user", "content": f"Task:\n{prompt}\n\nSolution:\n{completion}"}]}
    try:
        response = client.post(f"{config.base_url.rstrip('/')}/chat/completions", json=body,
                               headers=headers, timeout=config.timeout_s)
        response.raise_for_status()
        text = response.json()["choices"][0]["message"]["content"]
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise JudgeError(f"judge at {config.base_url} failed: {exc}") from exc
    match = re.search(r"score\s*[:=]?\s*(\d+(?:\.\d+)?)", text, re.IGNORECASE) or \
        re.search(r"(\d+(?:\.\d+)?)", text)
    if match is None:
        raise JudgeError(f"no score in the judge's reply: {text[:200]!r}")
    return min(max(float(match.group(1)), 0.0), 10.0) / 10.0


def check_judge(config: RewardConfig) -> None:
    """Ask the configured judge to score one trivial solution, before a run relies on it;
    raises JudgeError with the endpoint's failure. Nothing to check without a judge."""
    if config.judge is None or config.judge_weight <= 0:
        return
    with httpx.Client() as http:
        try:
            judge_score(config.judge, 'def one():\n    """Return 1."""\n',
                        "def one():\n    return 1\n", http)
        except JudgeError as exc:
            raise JudgeError(f"the judge failed its check before the run: {exc}") from exc


def compute_reward(*, prompt: str, code: str, tests: str, result: SandboxResult,
                   config: RewardConfig, test_files_before: dict[str, str] | None = None,
                   test_files_after: dict[str, str] | None = None,
                   client: httpx.Client | None = None) -> Reward:
    """The reward of one rollout. `test_files_*` map path -> sha256 (see `file_hashes`)."""
    flags = cheating_flags(code, tests, prompt)
    flags += [f"sandbox: {v}" for v in dict.fromkeys(result.violations)]  # once each
    if test_files_before is not None:
        flags += edited_tests(test_files_before, test_files_after or {})
    verifiable = verifiable_reward(result, config.mode, partial_credit=config.partial_credit)
    if flags:
        return Reward(value=0.0, verifiable=verifiable, flags=flags)
    judge = None
    if config.judge is not None and config.judge_weight > 0:
        with httpx.Client() if client is None else nullcontext(client) as http:
            judge = judge_score(config.judge, prompt, code, http)
    total = config.verifiable_weight + (config.judge_weight if judge is not None else 0.0)
    value = (config.verifiable_weight * verifiable + config.judge_weight * (judge or 0.0)) / \
        total if total > 0 else 0.0
    return Reward(value=value, verifiable=verifiable, judge=judge)


def tally_flags(rewards: Iterable[Reward]) -> Counter[str]:
    """How often each kind of flag (the text before ':') fired across a batch."""
    return Counter(flag.split(":")[0] for reward in rewards for flag in reward.flags)
