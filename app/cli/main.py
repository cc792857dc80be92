"""`flywheel`: one CLI for every part. `--help` answers without importing torch.

    flywheel init-model [--large] [--family F] [--out DIR]   build the tiny model + tokenizer
    flywheel up [--port P] [--data-dir D]       broker + API; prints READY <url> kafka=<host:port>
    flywheel demo [--data-dir D]                bootstrap, serve, learn from live feedback, JSON
    flywheel join [--data-dir D] [--kafka K]    sessions x feedback -> experiences (ingest/join)
    flywheel train-online [--nproc N]           experiences -> policy updates -> releases
    flywheel bootstrap [--nproc N] [--kafka K] [--agent CMD]  mid-training + GRPO, JSON
    flywheel rollout-worker --kafka K --store U [--agent CMD]  one more rollout worker
    flywheel keys create --user U [--rps R]     an inference key for /v1 (list, revoke KEY_ID)
    flywheel users delete USER [--reason R]     delete one user's untrained data (users deletions)

Settings come from FLYWHEEL_* variables; the flags here override them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import get_args

from pydantic import ValidationError

from app.cli.processes import (
    interrupt_on_sigterm,
    run_join_service,
    stop_on_signals,
    train_online_rank,
)
from app.settings import ADMIN_TOKEN_FILE, Settings, absolute, absolute_store_url
from simulate.agents import BUILTIN_ENTRY_POINT, AgentProgram
from trainer.config import ModelFamily


def _settings(args: argparse.Namespace) -> Settings:
    overrides = {}
    if getattr(args, "data_dir", None) is not None:
        overrides["data_dir"] = args.data_dir
    if getattr(args, "port", None) is not None:
        overrides["port"] = args.port
    if getattr(args, "host", None) is not None:
        overrides["host"] = args.host
    try:
        return Settings(**overrides)
    except ValidationError as error:  # a setting missing or wrong: its name, no traceback
        raise SystemExit(f"flywheel: the settings are invalid: {error}") from None


def cmd_init_model(args: argparse.Namespace) -> int:
    from trainer.config import TinyModelSettings
    from trainer.init_model import init_model

    settings = _settings(args)
    family = args.family or settings.model.family
    shape = (TinyModelSettings.large(family).model_copy(update={"dtype": settings.model.dtype})
             if args.large else settings.model.model_copy(update={"family": family}))
    out = init_model(shape, absolute(args.out) if args.out else settings.resolved_model_dir,
                     overwrite=args.overwrite)
    print(f"model ready in {out}")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from app.cli.stack import running_stack

    settings = _settings(args)
    stop = stop_on_signals()
    # no start-up deadline: loading and compiling a model of ~100M parameters or more can take
    # minutes on a few cores (the API's thread is alive all the while; its log says what it does)
    with running_stack(settings, start_timeout_s=None) as stack:
        if settings.admin_token_is_local:  # the path, never the token
            print(f"admin token: in {settings.data_dir / ADMIN_TOKEN_FILE} (or set "
                  "FLYWHEEL_ADMIN_TOKEN)", flush=True)
        print(f"READY {stack.base_url} kafka={stack.kafka.bootstrap}", flush=True)
        stop.wait()
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from app.cli.access import keys

    return keys(args, _settings(args))


def cmd_users(args: argparse.Namespace) -> int:
    from app.cli.access import users

    return users(args, _settings(args))


def cmd_train_online(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if settings.kafka_bootstrap is None:
        print("flywheel train-online: set FLYWHEEL_KAFKA_BOOTSTRAP", file=sys.stderr)
        return 2
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    if args.nproc is None:  # one process, or one rank of a world torchrun started
        return train_online_rank(settings.model_dump_json(), not args.no_release)
    from trainer.distributed import launch

    launch(args.nproc, train_online_rank, settings.model_dump_json(), not args.no_release,
           max_restarts=settings.online.max_restarts)
    return 0


def cmd_join(args: argparse.Namespace) -> int:
    settings = _settings(args)
    kafka = args.kafka or settings.kafka_bootstrap
    if kafka is None:
        print("flywheel join: set FLYWHEEL_KAFKA_BOOTSTRAP or --kafka", file=sys.stderr)
        return 2
    return run_join_service(settings.model_copy(update={"kafka_bootstrap": kafka}))


# `flywheel demo`'s flags: each sets the `DemoPlan` field it names (its default in the help)
DEMO_FLAGS: dict[str, tuple[str, type, str]] = {
    "--midtrain-steps": ("midtrain_steps", int, "the bootstrap's most mid-training steps"),
    "--midtrain-until": ("midtrain_until", float, "stop mid-training once unseen tasks' first "
                         "calls are written with this probability at 0.7 (0: run "
                         "--midtrain-steps exactly)"),
    "--grpo-steps": ("grpo_steps", int, "the bootstrap's GRPO steps"),
    "--releases": ("releases", int, "releases to hot-swap in the loop"),
    "--release-every-steps": ("release_every_steps", int,
                              "online trainer steps between releases"),
    "--online-batch": ("online_batch", int, "experiences per online trainer step"),
    "--min-sessions": ("min_sessions", int,
                       "sessions the newest release serves before the demo ends"),
    "--developers": ("concurrency", int, "simulated developers at once"),
    "--temperature": ("temperature", float, "the developers' sampling temperature"),
    "--canary-share": ("canary_share", float, "share of sessions a release serves until its "
                       "canary's test decides (0: no canary)"),
    "--canary-max-sessions": ("canary_max_sessions", int, "candidate sessions after which an "
                              "undecided canary is held, and the demo rolls it back"),
    "--loop-seconds": ("max_loop_s", float,
                       "a safety stop: most seconds of live traffic, whatever was reached"),
}


def cmd_demo(args: argparse.Namespace) -> int:
    from app.cli.demo import run_demo

    interrupt_on_sigterm()  # the broker, trainer and developers go down with it
    settings = _settings(args)
    if args.port is None:  # a demo must not collide with a running `flywheel up`
        settings = settings.model_copy(update={"port": 0})
    if args.smoke:
        return run_demo(settings, completions=args.completions)
    from app.cli.demo_loop import DemoPlan, run_demo_loop

    plan = DemoPlan(**{field: getattr(args, field) for field, _, _ in DEMO_FLAGS.values()
                       if getattr(args, field) is not None})
    return run_demo_loop(settings, plan)


def cmd_bootstrap(args: argparse.Namespace) -> int:
    import time

    settings = _settings(args)
    overrides = {k: v for k, v in (("max_steps", args.max_steps),
                                   ("time_budget_s", args.time_budget_s),
                                   ("midtrain_steps", args.midtrain_steps),
                                   ("midtrain_until", args.midtrain_until),
                                   ("mode", args.mode),
                                   ("agent", agent_program(args.agent))) if v is not None}
    cfg = settings.bootstrap.model_copy(update=overrides)
    run_dir = absolute(args.run_dir) if args.run_dir else cfg.run_dir or (
        settings.data_dir / "runs" / time.strftime("bootstrap-%Y%m%d-%H%M%S"))
    from simulate.rewards import JudgeError, check_judge
    from trainer.init_model import init_model  # torch from here on

    try:  # a judge that cannot score fails the run now, not mid-run
        check_judge(cfg.rewards)
    except JudgeError as error:
        raise SystemExit(f"flywheel bootstrap: {error}") from None
    model_dir = settings.resolved_model_dir
    if settings.model_dir is None:
        init_model(settings.model, model_dir)
    bootstrap = args.kafka or settings.kafka_bootstrap  # None: an embedded broker for the run
    interrupt_on_sigterm()  # its broker and rollout workers go down with it
    kafka = settings.kafka_config(bootstrap).model_dump_json() if bootstrap else None
    job = (cfg.model_dump_json(), str(model_dir), str(run_dir), not args.no_progress,
           settings.batch_invariant, settings.trackers.model_dump_json(), kafka)
    if args.nproc is None:  # one process, or one rank of a world torchrun started
        return bootstrap_rank(*job)
    from trainer.distributed import launch

    launch(args.nproc, bootstrap_rank, *job, max_restarts=0)
    return 0


def bootstrap_rank(cfg_json: str, model_dir: str, run_dir: str, progress: bool,
                   batch_invariant: bool, trackers_json: str | None = None,
                   kafka_json: str | None = None) -> int:
    """One rank of `flywheel bootstrap` (the whole of it in the one-process world): the
    leader runs the bootstrap and prints its JSON line, the others follow its training."""
    import json

    from ingest.config import KafkaConfig
    from trainer.bootstrap.config import BootstrapSettings
    from trainer.bootstrap.run import run_bootstrap
    from trainer.distributed import join_world, leave_world
    from trainer.trackers import TrackerSettings

    # the launcher stops the ranks with SIGTERM when one fails: the leader's broker and
    # rollout workers go with it
    interrupt_on_sigterm()
    cfg = BootstrapSettings.model_validate_json(cfg_json)
    trackers = TrackerSettings.model_validate_json(trackers_json or "{}")
    world = join_world(timeout_s=1800.0)  # the others wait in one while the leader evaluates
    try:
        summary = run_bootstrap(cfg, Path(model_dir), Path(run_dir), progress=progress,
                                batch_invariant=batch_invariant, world=world,
                                trackers=trackers, kafka=KafkaConfig.model_validate_json(
                                    kafka_json) if kafka_json else None,
                                worker_module="app.rollouts.worker")
    finally:
        leave_world(world)
    if world.leader:
        print(f"run dir: {run_dir}", file=sys.stderr)
        print(json.dumps(summary), flush=True)
    return 0


def agent_program(command: str | None) -> AgentProgram | None:
    """`--agent`: "builtin" (the built-in harness, as an entry point), an entry point
    (`package.module:function` or `file.py:function`, forked per episode from a warm host), or
    a command line started per episode; file names here are made absolute (an agent runs in
    its workspace)."""
    if command is None:
        return None
    import shlex

    if command == "builtin":
        return AgentProgram(entry_point=BUILTIN_ENTRY_POINT)
    target, colon, function = command.rpartition(":")
    if colon and " " not in command and function.isidentifier():
        if target.endswith(".py"):
            target = str(Path(target).resolve())
        return AgentProgram(entry_point=f"{target}:{function}")
    return AgentProgram(command=[str(Path(word).resolve()) if Path(word).is_file() else word
                                 for word in shlex.split(command)])


def cmd_rollout_worker(args: argparse.Namespace) -> int:
    from app.rollouts.worker import agent_groups
    from simulate.rollout_worker import WorkerLaunch, host_worker_id, run_worker

    settings = _settings(args)
    bootstrap = args.kafka or settings.kafka_bootstrap
    if not bootstrap:
        print("flywheel rollout-worker: give the bootstrap's broker (--kafka or "
              "FLYWHEEL_KAFKA_BOOTSTRAP)", file=sys.stderr)
        return 2
    cfg = settings.bootstrap.model_copy(update={"agent": agent_program(args.agent)}) \
        if args.agent else settings.bootstrap
    store = absolute_store_url(args.store) if args.store else cfg.policy_store_url
    if not store:
        print("flywheel rollout-worker: give the bootstrap's policy store (--store or "
              "FLYWHEEL_BOOTSTRAP__POLICY_STORE_URL)", file=sys.stderr)
        return 2
    options = cfg.worker_options(args.worker_id or host_worker_id(),
                                 batch_invariant=settings.batch_invariant)
    for name in ("simulate", "serving", "app.rollouts"):
        logging.getLogger(name).setLevel(logging.INFO)
    run_worker(WorkerLaunch(kafka=settings.kafka_config(bootstrap), store_url=store,
                            options=options), stop_on_signals(),
               agent_groups if options.agent is not None else None)
    return 0


AGENT_HELP = ("train this agent program's episodes (docs/bootstrap.md: the agent contract) "
              "against an OpenAI endpoint the worker serves: a command started per episode, "
              "or MODULE:FUNCTION / FILE.py:FUNCTION forked per episode from a warm host; "
              "'builtin': the built-in harness as one")


def build_parser() -> argparse.ArgumentParser:
    from app.cli.demo_loop import DemoPlan  # its defaults, in the help (no torch imported)

    parser = argparse.ArgumentParser(prog="flywheel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def with_common(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--data-dir", type=Path, help="all state lives here (default: data)")
        return p

    p = with_common(sub.add_parser("init-model", help="build the default model locally"))
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--large", action="store_true",
                   help="the family at ~100M parameters (a speed check where compute matters: "
                        "~124M for a MoE, ~107M dense) instead of FLYWHEEL_MODEL__*'s shape")
    p.add_argument("--family", choices=get_args(ModelFamily),
                   help="the Hugging Face family at that shape (default: FLYWHEEL_MODEL__FAMILY, "
                        "qwen3_moe)")
    p.add_argument("--out", type=Path, help="where to write it (default: the model dir)")
    p.set_defaults(func=cmd_init_model)
    p = with_common(sub.add_parser("up", help="start broker + API on this machine"))
    p.add_argument("--port", type=int)
    p.add_argument("--host")
    p.set_defaults(func=cmd_up)
    p = with_common(sub.add_parser("train-online", help="train on live feedback, release"))
    p.add_argument("--no-release", action="store_true", help="train and checkpoint only")
    p.add_argument("--nproc", type=int, help="shard the trainer over N local ranks (FSDP2; "
                   "gloo on CPU, NCCL on GPUs); under torchrun, leave it out")
    p.set_defaults(func=cmd_train_online)
    p = with_common(sub.add_parser("join", help="join sessions with feedback into experiences"))
    p.add_argument("--kafka", metavar="SERVERS",
                   help="Kafka bootstrap servers (default: FLYWHEEL_KAFKA_BOOTSTRAP)")
    p.set_defaults(func=cmd_join)
    p = with_common(sub.add_parser("bootstrap", help="mid-train + GRPO on verifiable tasks"))
    p.add_argument("--run-dir", type=Path, help="default: <data-dir>/runs/bootstrap-<time>")
    p.add_argument("--max-steps", type=int)
    p.add_argument("--time-budget-s", type=float, help="GRPO wall budget")
    p.add_argument("--midtrain-steps", type=int)
    p.add_argument("--midtrain-until", type=float, help="stop mid-training early once unseen "
                   "tasks' first calls are written with this probability (at 0.7)")
    p.add_argument("--mode", choices=["async", "sync"])
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--nproc", type=int, help="shard the learner over N local ranks (FSDP2); "
                   "under torchrun, leave it out")
    p.add_argument("--kafka", metavar="SERVERS", help="the fleet's broker (default: "
                   "FLYWHEEL_KAFKA_BOOTSTRAP, else an embedded one for the run)")
    p.add_argument("--agent", metavar="CMD", help=AGENT_HELP)
    p.set_defaults(func=cmd_bootstrap)
    p = with_common(sub.add_parser("rollout-worker", help="make rollout groups for a bootstrap "
                                   "(jobs from Kafka, policy versions from the store)"))
    p.add_argument("--kafka", metavar="SERVERS",
                   help="the bootstrap's broker (default: FLYWHEEL_KAFKA_BOOTSTRAP)")
    p.add_argument("--store", metavar="URL", help="the bootstrap's policy store (default: "
                   "FLYWHEEL_BOOTSTRAP__POLICY_STORE_URL)")
    p.add_argument("--worker-id", help="default: <hostname>-<pid>")
    p.add_argument("--agent", metavar="CMD", help=AGENT_HELP)
    p.set_defaults(func=cmd_rollout_worker)
    p = with_common(sub.add_parser("keys", help="inference keys: create, list, revoke"))
    keys = p.add_subparsers(dest="action", required=True)
    create = with_common(keys.add_parser("create", help="a key for one user (printed once)"))
    create.add_argument("--user", required=True, help="the user id its generations log")
    create.add_argument("--rps", type=float, help="requests per second (per API replica)")
    create.add_argument("--label")
    create.add_argument("--private", action="store_true",
                        help="every request in privacy mode (never logged nor trained on)")
    with_common(keys.add_parser("list", help="every key, without secrets"))
    revoke = with_common(keys.add_parser("revoke", help="refused within a second"))
    revoke.add_argument("key_id")
    p.set_defaults(func=cmd_keys)
    p = with_common(sub.add_parser("users", help="delete a user's data not yet trained"))
    users = p.add_subparsers(dest="action", required=True)
    delete = with_common(users.add_parser(
        "delete", help="forget every generation of USER up to now (join state, experiences "
        "not yet trained; tombstones on compacted topics)"))
    delete.add_argument("user", help="the user id their generations logged")
    delete.add_argument("--reason", default="", help="kept with the record")
    delete.add_argument("--kafka", metavar="SERVERS",
                        help="for tombstones (default: FLYWHEEL_KAFKA_BOOTSTRAP)")
    with_common(users.add_parser("deletions", help="the deletions made, newest first"))
    p.set_defaults(func=cmd_users)
    p = with_common(sub.add_parser("demo", help="run the loop end to end and print JSON"))
    p.add_argument("--completions", type=int, default=4, help="with --smoke")
    p.add_argument("--smoke", action="store_true",
                   help="only exercise the API and Kafka (no training loop)")
    plan = DemoPlan()
    for flag, (field, kind, text) in DEMO_FLAGS.items():
        p.add_argument(flag, type=kind, dest=field, metavar="N" if kind is int else "X",
                       help=f"{text} ({getattr(plan, field)})")
    p.add_argument("--port", type=int, help="API port (default: a free one)")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    # kafka-python logs every refused connection while the embedded broker boots.
    logging.getLogger("kafka").setLevel(logging.ERROR)
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
