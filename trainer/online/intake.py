"""What the online trainer's loop takes from `experiences`: the source and the batches.

`ExperienceSource` is the `EventConsumer` on `experiences`, assigned every partition by hand
and seeking to the offsets of the latest checkpoint; `take_batch` cuts a prefix of the polled
records (so resuming after a batch is one offset per partition) and skips what the ledger has,
what a deleted user generated (`ingest.deletions.Forgotten`, read before each batch) and what
is staler than `max_staleness` releases allow (`stale_before`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from ingest.config import KafkaConfig
from ingest.events import ExperienceReady
from ingest.join_store import as_utc
from ingest.log import Delivered, EventProducer
from ingest.topic_reader import Offsets, TopicReader, offset_key
from trainer.checkpoint import Ledger

ExperienceSource = TopicReader[ExperienceReady]


def experience_source(config: KafkaConfig, *, group_id: str, dlq: EventProducer | None
                      ) -> ExperienceSource:
    """Every partition of `experiences`, assigned by hand (no group rebalance to wait for
    after a restart), from `group_id`'s committed offsets until the loop seeks to its
    checkpoint's; the loop commits explicit offsets once a checkpoint is durable."""
    return TopicReader(config, config.topics.experiences, ExperienceReady, start="committed",
                       group_id=group_id, dlq=dlq, max_poll_records=500)


@dataclass
class Batch:
    experiences: list[ExperienceReady]
    offsets: Offsets  # where to resume after this batch
    skipped: int  # already trained (in the ledger, or twice in the batch)
    forgotten: int = 0  # of users deleted after generating them
    stale: int = 0  # generated before the staleness bound's cut (`stale_before`)


def stale_before(published_at: Sequence[float], max_staleness: int | None) -> float | None:
    """The cut of the staleness bound: generations made before the trainer's last
    `max_staleness + 1` releases were published (`published_at`, oldest first) are stale.
    None (no bound, or fewer releases so far) keeps everything; else unix seconds.

    By time, not by `model_version`: after an admin's rollback the served version is older
    than the trainer's last release, and its new traffic must count as fresh."""
    if max_staleness is None or len(published_at) <= max_staleness:
        return None
    return published_at[-(max_staleness + 1)]


def take_batch(pending: list[Delivered[Any]], ledger: Ledger, *, min_batch: int,
               max_batch: int, forgotten: Callable[[ExperienceReady], bool] | None = None,
               stale_cut: float | None = None,
               stale_versions: Collection[int] = ()) -> Batch | None:
    """The longest prefix of `pending` holding at most `max_batch` untrained experiences, or
    None while fewer than `min_batch` are waiting. Consumes the prefix from `pending`.
    Experiences `forgotten` says are a deleted user's are passed over, never trained, and so
    are those generated before `stale_cut` or by one of `stale_versions`.

    Taking a prefix keeps each partition's records in offset order, so "resume after this
    batch" is one offset per partition: the last taken + 1.
    """
    fresh: set[str] = set()
    taken: list[ExperienceReady] = []
    dropped = stale = cut = 0
    for cut, record in enumerate(pending, start=1):  # noqa: B007 (cut is used after)
        exp: ExperienceReady = record.event
        if forgotten is not None and forgotten(exp):
            dropped += 1
        elif (stale_cut is not None and as_utc(exp.generated_at).timestamp() < stale_cut
              or exp.model_version in stale_versions):
            stale += 1
        elif not (ledger.contains(exp.experience_id) or exp.experience_id in fresh):
            fresh.add(exp.experience_id)
            taken.append(exp)
            if len(taken) == max_batch:
                break
    if len(taken) < min_batch:
        return None
    offsets: Offsets = {}
    for record in pending[:cut]:
        offsets[offset_key(record.topic, record.partition)] = record.offset + 1
    del pending[:cut]
    return Batch(taken, offsets, cut - len(taken) - dropped - stale, dropped, stale)
