"""Entry points that run as a process of their own (`flywheel train-online`'s ranks, the
join, the demo's trainer and join), apart from the CLI that parses their flags: the demo
starts them without importing the CLI, which imports the demo."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from app.settings import Settings


def stop_on_signals() -> threading.Event:
    """An event that SIGINT or SIGTERM sets, so long-running commands stop cleanly."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as Ctrl-C's KeyboardInterrupt is (`interrupt_on_sigterm`)."""


def interrupt_on_sigterm() -> None:
    """SIGTERM raises `Terminated`, a KeyboardInterrupt as Ctrl-C's, so a command that owns
    child processes (the embedded broker, rollout workers, the demo's trainer) stops them on
    its way out instead of leaving them behind.

    Python runs a signal's handler wherever the main thread is, a finalizer included, and
    prints and drops an exception raised in a finalizer (`__del__`, a weakref callback):
    a SIGTERM that lands there is sent again a moment later (`sys.unraisablehook`), once the
    main thread is back in the program's own code. (One `kill` in five left `flywheel
    bootstrap` mid-training, the KeyboardInterrupt dropped in a `regex` pattern's
    `__del__`.)"""
    global _unraisable_hook
    signal.signal(signal.SIGTERM, _raise_terminated)
    if sys.unraisablehook is not _terminate_again:
        _unraisable_hook, sys.unraisablehook = sys.unraisablehook, _terminate_again


def _raise_terminated(*_: object) -> None:
    raise Terminated("SIGTERM")


_unraisable_hook: Callable[[Any], object] = sys.__unraisablehook__


def _terminate_again(unraisable: Any) -> None:
    """`sys.unraisablehook`: a `Terminated` a finalizer swallowed is signalled again, from
    a thread, once the main thread has left the finalizer (signalled from here, the handler
    would run, and raise, before this hook returns)."""
    if isinstance(unraisable.exc_value, Terminated):
        again = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM))
        again.daemon = True
        again.start()
        return
    _unraisable_hook(unraisable)


def train_online_rank(settings_json: str, release: bool) -> int:
    """One rank of `flywheel train-online` (the whole of it in the one-process world): the
    leader takes the trainer control and the release pipeline, the others follow it."""
    from trainer.distributed import join_world, leave_world
    from trainer.online.process import run_online

    settings = Settings.model_validate_json(settings_json)
    world = join_world(timeout_s=settings.online.collective_timeout_s)
    stop = stop_on_signals()
    control, sink, forgotten = None, None, None
    if world.leader:
        from ingest.deletions import Forgotten, open_deletions_db
        from trainer.online.control import SqlTrainerControl, open_control_db
        from trainer.release.pipeline import PipelineReleaseSink

        control = SqlTrainerControl(open_control_db(settings.resolved_database_url))
        forgotten = Forgotten(open_deletions_db(settings.resolved_database_url))
        sink = PipelineReleaseSink(settings.release_config()) if release else None
    try:
        report = run_online(settings, world=world, release_sink=sink, control=control,
                            stop=stop, forgotten=forgotten)
    finally:
        leave_world(world)
    if world.leader:
        print(f"trained {report.consumed} experiences in {report.steps} steps", flush=True)
    return 0


def join_process(settings_json: str) -> int:
    """`run_join_service` in a spawned process (the settings travel as JSON)."""
    return run_join_service(Settings.model_validate_json(settings_json))


def run_join_service(settings: Settings) -> int:
    """`flywheel join` on the broker `settings.kafka_bootstrap` names, until SIGINT or SIGTERM."""
    from app.heap import settle_heap
    from ingest.join import run_join

    if settings.kafka_bootstrap is None:
        raise ValueError("the join needs a broker: set FLYWHEEL_KAFKA_BOOTSTRAP or --kafka")
    stop = stop_on_signals()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    settle_heap()
    run_join(settings.kafka_config(settings.kafka_bootstrap), settings.join,
             database_url=settings.resolved_join_database_url, stop=stop)
    return 0
