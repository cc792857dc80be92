"""A rollout job's group made by an agent program: one process per episode, on the endpoint.

Each episode (`AgentGroups.episode`) gets a fresh session, key and verdict secret on the
worker's endpoint (app/rollouts/endpoint.py), a workspace holding the task's files and a task
file beside it, and runs the program (`simulate.agents.AgentProgram`: a command started per
episode, or an entry point forked per episode from its warm host, app/rollouts/warm_host.py)
with the contract's environment (`simulate.agents.AGENT_ENV`, plus PATH, LANG, PYTHONPATH
and a HOME of its own, nothing else of the worker's). Its walls: its own process group,
killed whole at the deadline or when the episode ends; address space and CPU seconds by
rlimit; its output kept only as a bounded tail for the log; its request budget on the
endpoint. It does not get a network namespace of its own, as the sandbox's jobs do: it must
reach the endpoint on loopback.

The episode is dropped, counted by reason, and made again (up to `attempts` times) when the
program exits non-zero or is killed ("crashed"), passes its deadline ("deadline"), exits
without a verdict ("no_verdict") or without a generation ("no_generations"), signs a verdict
for another session ("forged_verdict"), floods the endpoint ("flood") or samples at another
temperature than the job's ("temperature"). Nothing of a dropped episode trains: its records
die with it. Otherwise the group's trajectory is built from the endpoint's records
(`simulate.rollouts.episode_trajectory`) and scored on the workspace (the task's tests and the
anti-cheat checks, through the worker's sandbox cache) or by the verdict.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import tempfile
import uuid
from collections import Counter
from functools import partial
from pathlib import Path

from app.rollouts.endpoint import Episode, RolloutEndpoint
from app.rollouts.warm_host import WarmHost
from ingest.config import RewardMap
from ingest.feedback_rewards import reward_for
from ingest.rollout_events import RolloutGroup, RolloutJob, RolloutTrajectory
from simulate.agent_host import set_walls
from simulate.agents import AgentProgram, DropReason
from simulate.rollouts import SandboxCache, TaskEnvironment, episode_trajectory
from simulate.tasks import Task

log = logging.getLogger(__name__)

PASSED_THROUGH = ("PATH", "LANG", "PYTHONPATH")  # of the worker's environment


class AgentFailure(RuntimeError):
    """An episode slot was dropped `attempts` times: the agent program cannot make this job."""


class AgentGroups:
    """Makes jobs' groups with `program` against `endpoint`, in `workdir`."""

    def __init__(self, program: AgentProgram, endpoint: RolloutEndpoint, cache: SandboxCache,
                 workdir: Path) -> None:
        self.program, self.endpoint, self.cache, self.workdir = program, endpoint, cache, workdir
        self.dropped: Counter[str] = Counter()  # over the worker's life
        # an entry point's episodes are forked by one warm host (simulate/agent_host.py)
        self.host = WarmHost(program.argv(sys.executable), _passed_through()) \
            if program.entry_point is not None else None

    async def group(self, job: RolloutJob) -> RolloutGroup:
        """`job`'s group: `group_size` episodes at once, each made again until it counts."""
        task = Task.model_validate(job.task)
        dropped: Counter[str] = Counter()

        async def slot(i: int) -> tuple[RolloutTrajectory, int]:
            seed = job.seed * 1000 + i  # as the built-in harness seeds its episodes
            for _ in range(self.program.attempts):
                made = await self.episode(job, task, seed=seed)
                if not isinstance(made, str):
                    return made
                dropped[made] += 1
            raise AgentFailure(f"{job.job_id}: episode {i} was dropped {self.program.attempts} "
                               f"times ({dict(dropped)}); the agent's output is in the log")

        made = await asyncio.gather(*(slot(i) for i in range(job.group_size)))
        self.dropped.update(dropped)
        return RolloutGroup(group_id=job.job_id, task_id=task.task_id,
                            policy_version=min(version for _, version in made),
                            trajectories=[trajectory for trajectory, _ in made],
                            dropped=dict(dropped))

    async def episode(self, job: RolloutJob, task: Task, *, seed: int
                      ) -> tuple[RolloutTrajectory, int] | DropReason:
        """One episode: (its trajectory, its policy version), or why it was dropped."""
        session_id = f"rollout-{uuid.uuid4().hex}"
        with tempfile.TemporaryDirectory(dir=self.workdir, prefix="episode-") as tmp:
            root = Path(tmp)
            env = TaskEnvironment(task, root / "workspace", self.cache, job.rewards)
            (root / "task.json").write_text(task.model_dump_json())
            (root / "home").mkdir()
            episode = self.endpoint.open(session_id, temperature=job.sampling.temperature,
                                         max_requests=self.program.max_requests)
            try:
                ended = await self._run(episode, root, job, seed)
            finally:
                self.endpoint.close(episode)
            why = episode.dropped or ended or (
                "no_generations" if not episode.records else
                "no_verdict" if episode.verdict is None else None)
            if why is not None:
                return why
            assert episode.verdict is not None
            if self.program.reward == "verdict":
                reward, flags = reward_for(episode.verdict, RewardMap()), []
            else:
                scored = await asyncio.to_thread(env.reward)
                reward, flags = scored.value, scored.flags
        records = sorted(episode.records, key=lambda r: r.created_at)
        return (episode_trajectory(records, task_id=task.task_id, reward=reward, flags=flags),
                min(r.model_version for r in records))

    async def _run(self, episode: Episode, root: Path, job: RolloutJob, seed: int
                   ) -> DropReason | None:
        """Run the program's episode and wait for it; "crashed" or "deadline", or None."""
        program = self.program
        environ = _passed_through() | {
            "HOME": str(root / "home"),
            "OPENAI_BASE_URL": f"{self.endpoint.base_url}/v1",
            "OPENAI_API_KEY": episode.key,
            "FLYWHEEL_SESSION_ID": episode.session_id,
            "FLYWHEEL_TASK": str(root / "task.json"),
            "FLYWHEEL_WORKSPACE": str(root / "workspace"),
            "FLYWHEEL_SAMPLING": job.sampling.model_dump_json(),
            "FLYWHEEL_SEED": str(seed),
            "FLYWHEEL_FEEDBACK_URL": f"{self.endpoint.base_url}/v1/feedback",
            "FLYWHEEL_FEEDBACK_SECRET": episode.secret}
        if self.host is not None:
            code = await self.host.run({
                "episode": episode.session_id, "env": environ, "cwd": str(root / "workspace"),
                "output": str(root / "output.log"), "memory_mb": program.memory_mb,
                "cpu_seconds": program.cpu_seconds}, deadline_s=program.deadline_s)
            tail = _file_tail(root / "output.log", program.output_chars)
        else:
            code, tail = await self._process(environ, root / "workspace")
        if code == 0:
            return None
        log.warning("episode %s: the agent %s; its output ends:\n%s", episode.session_id,
                    f"exited with {code}" if code is not None
                    else f"ran past its {program.deadline_s:g}s deadline", tail)
        return "crashed" if code is not None else "deadline"

    async def _process(self, environ: dict[str, str], cwd: Path) -> tuple[int | None, str]:
        """The command as a process of its own: (its exit code, None past the deadline; the
        tail of its output)."""
        program = self.program
        proc = await asyncio.create_subprocess_exec(
            *program.argv(sys.executable), cwd=cwd, env=environ,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            preexec_fn=partial(set_walls, program.memory_mb, program.cpu_seconds))
        output = asyncio.create_task(_tail(proc.stdout, program.output_chars))
        try:
            code: int | None = await asyncio.wait_for(proc.wait(), timeout=program.deadline_s)
        except TimeoutError:
            code = None
        finally:
            with contextlib.suppress(ProcessLookupError):  # the whole group, whatever ended it
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        return code, await output

    def close(self) -> None:
        if self.host is not None:
            self.host.close()


def _passed_through() -> dict[str, str]:
    """What an agent gets of the worker's environment (`PASSED_THROUGH`)."""
    return {name: os.environ[name] for name in PASSED_THROUGH if name in os.environ}


def _file_tail(path: Path, limit: int) -> str:
    if not path.exists() or not limit:
        return ""
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - limit))
        return f.read().decode(errors="replace")


async def _tail(stream: asyncio.StreamReader | None, limit: int) -> str:
    """Read `stream` to its end, keeping its last `limit` characters."""
    kept = b""
    while stream is not None and (chunk := await stream.read(65536)):
        kept = (kept + chunk)[-limit:] if limit else b""
    return kept.decode(errors="replace")
