"""A candidate handed to the release pipeline, built on a thread while the trainer trains on.

The pipeline's build (trainer/release/pipeline.py: eval gate, delta, store, announce) takes
as long as the gate's episodes, and the served release keeps generating meanwhile. Until the
candidate is published that release is still the newest, so what it serves is fresh under
any staleness bound: the trainer trains on it, from the candidate's weights, instead of
letting it go stale while it waits. The weights handed over are stashed first (the KL
anchor from then on, and what ships), since the trainer's own move on.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.release.pipeline import ReleaseOutcome, ReleaseSink

log = logging.getLogger(__name__)


@dataclass
class Handoff:
    """One candidate in the pipeline: `outcome` once built, `error` if the build raised."""

    step_range: list[int]  # the trainer steps the candidate holds
    sha256: str  # the trainer's stash of the candidate's weights
    command_id: int | None = None  # the admin's command that asked for it, answered at the end
    outcome: ReleaseOutcome | None = None
    error: BaseException | None = None
    _thread: threading.Thread | None = field(default=None, repr=False)

    def start(self, sink: ReleaseSink, candidate: Path, provenance: dict[str, Any], *,
              requested_by: str, reason: str) -> Handoff:
        def build() -> None:
            try:
                self.outcome = sink.release(candidate, provenance, requested_by=requested_by,
                                            reason=reason)
            except Exception as exc:  # the pipeline recorded the failed build
                log.exception("the release of steps %s failed", self.step_range)
                self.error = exc

        self._thread = threading.Thread(target=build, name="release-build", daemon=True)
        self._thread.start()
        return self

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def result(self) -> dict[str, Any]:
        """What the loop reports of it (`released` is False for a canary until decided)."""
        if self.outcome is None:
            return {"released": False, "reason": f"build failed: {self.error}",
                    "step_range": self.step_range}
        outcome = self.outcome
        return {"released": outcome.published and not outcome.canary,
                "version": outcome.version, "sha256": outcome.sha256,
                "reason": outcome.reason, "step_range": self.step_range}
