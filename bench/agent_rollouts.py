"""Rollout throughput of agent programs over the OpenAI API against the in-process harness.

Makes the same GRPO groups (the same train tasks, seeds and mid-trained weights, on one engine)
three ways, alternating them round by round so that a shared machine's drift hits all:

- `in_process`: the built-in harness on token ids in the worker (the default bootstrap);
- `builtin_agent`: the same harness as an agent program (`simulate.builtin_agent:main`, forked
  per episode from its warm host) over the worker's endpoint (app/rollouts/);
- `example_agent`: examples/agents/coding_agent.py (the OpenAI Agents SDK), likewise;

and, with `--command`, the built-in agent started as a process per episode. Prints samples/s
of each and their ratios to `in_process`; no training. A first round of each is made untimed
(`--warm-rounds`): an entry point's warm host starts once in a worker's life (its imports, about
2 s of CPU for the Agents SDK), which a bootstrap's thousands of episodes share.

Where the machine's CPU went, per sample, for each (`cpu_ms_per_sample`): the engine's thread,
the endpoint's (HTTP, templates, tokenizing), the rest of the worker's process, and its child
processes (the agents and their warm hosts, the sandboxes' zygotes and jobs, the broker). The
in-process harness is bound by the engine's thread; agents add the rest, so on a machine of C
cores the agents' samples/s can reach at most C / (the sum) while the engine's thread keeps up.

    .venv/bin/python bench/agent_rollouts.py [--rounds 3] [--warm-rounds 1] [--groups 4]
                                             [--midtrain-steps 350]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.settings import Settings  # noqa: E402
from bench.proc_cpu import children, cpu_seconds, thread_cpu_seconds  # noqa: E402

THREADS = {"engine": "engine", "rollout-endpoint": "endpoint"}  # thread name -> part


def cpu_now() -> dict[str, float]:
    """CPU seconds so far: this process's engine and endpoint threads, the rest of it, and
    its descendants (each one's own and its reaped children's)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = dict.fromkeys(("engine", "endpoint", "rest_of_worker", "processes"), 0.0)
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            out[THREADS.get(names.get(tid, ""), "rest_of_worker")] += thread_cpu_seconds(tid)
        except (FileNotFoundError, ProcessLookupError):  # ended just now
            continue
    out["processes"] = sum(cpu_seconds(child, reaped=True) for child in children(os.getpid()))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm-rounds", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--groups", type=int, default=4, help="groups made together per round")
    parser.add_argument("--midtrain-steps", type=int, default=350)
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--command", action="store_true",
                        help="also the built-in agent as a process per episode")
    args = parser.parse_args(argv)
    settings = Settings()

    from app.rollouts.agent_groups import AgentGroups
    from app.rollouts.endpoint import RolloutEndpoint
    from bench.common import bench_start
    from ingest.broker import open_broker
    from ingest.config import KafkaConfig
    from ingest.log import EventProducer, ensure_topics
    from ingest.rollout_events import RolloutJob, RolloutSampling
    from simulate.agents import BUILTIN_AGENT, BUILTIN_ENTRY_POINT, AgentProgram
    from simulate.rollouts import SandboxCache, rollout_group
    from simulate.tasks import Task
    from trainer.bootstrap.local_engine import build_harness, make_engine

    cfg = settings.bootstrap
    start = bench_start(cfg, settings.model, args.model_dir, steps=args.midtrain_steps)
    engine = make_engine(start.policy(lr=cfg.lr), cfg, seed=cfg.seed)
    example = ROOT / "examples" / "agents" / "coding_agent.py"
    programs = {"builtin_agent": AgentProgram(entry_point=BUILTIN_ENTRY_POINT),
                "example_agent": AgentProgram(entry_point=f"{example}:main")}
    if args.command:
        programs["builtin_agent_command"] = AgentProgram(command=BUILTIN_AGENT)
    sampling = RolloutSampling(temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                               max_turns=cfg.max_turns, context_budget=cfg.context_budget)
    seconds = {name: 0.0 for name in ("in_process", *programs)}
    cpu: dict[str, dict[str, float]] = {name: {} for name in seconds}
    samples = 0
    with open_broker(None) as bootstrap, tempfile.TemporaryDirectory() as tmp:
        kafka = KafkaConfig(bootstrap=bootstrap)
        ensure_topics(kafka)
        producer = EventProducer(kafka, client_id="bench-agent-rollouts")
        with RolloutEndpoint.serve(engine, producer, kafka, Path(tmp)) as endpoint:
            makers = {name: AgentGroups(program, endpoint, SandboxCache(), Path(tmp))
                      for name, program in programs.items()}
            harness = build_harness(engine, cfg, temperature=cfg.temperature)
            in_process_cache = SandboxCache()
            try:
                for r in range(args.warm_rounds + args.rounds):
                    timed = r >= args.warm_rounds
                    rng = random.Random(cfg.seed + r)
                    jobs = [RolloutJob(job_id=f"r{r}-{i}", run_id="bench", step=0,
                                       min_version=0, group_size=cfg.group_size,
                                       seed=1000 * r + i, sampling=sampling,
                                       task=rng.choice(start.train).model_dump(mode="json"))
                            for i in range(args.groups)]
                    for name in seconds:
                        async def groups() -> None:
                            if name == "in_process":  # noqa: B023
                                await asyncio.gather(*(rollout_group(
                                    harness, Task.model_validate(j.task),
                                    group_size=j.group_size, cache=in_process_cache,
                                    seed=j.seed) for j in jobs))  # noqa: B023
                            else:
                                await asyncio.gather(*(makers[name].group(j)  # noqa: B023
                                                       for j in jobs))  # noqa: B023

                        began, cpu_began = time.perf_counter(), cpu_now()
                        asyncio.run(groups())
                        if timed:
                            seconds[name] += time.perf_counter() - began
                            for part, spent in cpu_now().items():
                                cpu[name][part] = (cpu[name].get(part, 0.0)
                                                   + spent - cpu_began[part])
                    if not timed:
                        continue
                    samples += args.groups * cfg.group_size
                    print(f"round {r + 1 - args.warm_rounds}: " + "  ".join(
                        f"{n} {samples / s:6.2f} samples/s" for n, s in seconds.items()),
                        flush=True)
            finally:
                for maker in makers.values():
                    maker.close()
        producer.close()
    engine.close()
    rates = {name: samples / s for name, s in seconds.items()}
    result: dict[str, object] = {"bench": "agent_rollouts", "samples": samples}
    for name, rate in rates.items():
        result[f"{name}_samples_per_s"] = round(rate, 3)
        if name != "in_process":
            result[f"ratio_{name}"] = round(rate / rates["in_process"], 3)
    result["cpu_ms_per_sample"] = {name: {part: round(1000 * spent / samples, 1)
                                          for part, spent in parts.items()}
                                   for name, parts in cpu.items()}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
