"""`python -m app.rollouts.worker '<WorkerLaunch JSON>'`: a rollout worker whose groups an
agent program makes (`WorkerOptions.agent`; without one, the built-in harness in-process, as
`python -m simulate.rollout_worker`). `flywheel bootstrap --agent` starts its workers so, and
`flywheel rollout-worker --agent` runs one on any host."""

from __future__ import annotations

import logging
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from app.rollouts.agent_groups import AgentGroups
from app.rollouts.endpoint import RolloutEndpoint
from simulate.rollout_worker import FleetWorker, GroupMaker, WorkerLaunch, run_worker

log = logging.getLogger(__name__)


@contextmanager
def agent_groups(worker: FleetWorker) -> Iterator[GroupMaker]:
    """The worker's endpoint served for the run, and its agent program's group maker."""
    program = worker.options.agent
    assert program is not None
    with tempfile.TemporaryDirectory(prefix="flywheel-agent-") as tmp, RolloutEndpoint.serve(
            worker.engine, worker.producer, worker.kafka, Path(tmp)) as endpoint:
        log.info("%s: agent %s against %s", worker.options.worker_id,
                 program.entry_point or " ".join(program.argv(sys.executable)),
                 endpoint.base_url)
        groups = AgentGroups(program, endpoint, worker.cache, Path(tmp))
        try:
            yield groups.group
        finally:
            groups.close()
        log.info("%s: agent episodes dropped and made again: %s", worker.options.worker_id,
                 dict(groups.dropped))


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    launch = WorkerLaunch.model_validate_json(argv[0])
    run_worker(launch, stop, agent_groups if launch.options.agent is not None else None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
