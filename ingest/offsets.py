"""How far consumers are behind the log: end offsets and a group's committed offsets.

`OffsetProbe` joins no group: it asks the broker for each partition's end offset (a consumer
without a group) and for the offsets a group committed (the admin client's OffsetFetch), so
reading the join's lag never rebalances the join. The console and `/metrics` use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition

from ingest.config import KafkaConfig


@dataclass(frozen=True)
class PartitionLag:
    topic: str
    partition: int
    end: int  # the next offset the log will write
    committed: int | None  # the group's committed offset; None: never committed
    lag: int  # records written that the group has not committed past


class OffsetProbe:
    """End offsets and committed offsets, read on demand; `close` when done."""

    def __init__(self, config: KafkaConfig) -> None:
        self.config = config
        self._consumer = KafkaConsumer(bootstrap_servers=config.bootstrap, group_id=None,
                                       enable_auto_commit=False,
                                       request_timeout_ms=config.request_timeout_ms)
        self._admin = KafkaAdminClient(bootstrap_servers=config.bootstrap,
                                       request_timeout_ms=config.request_timeout_ms)

    def partitions(self, topic: str) -> list[TopicPartition]:
        return [TopicPartition(topic, p)
                for p in sorted(self._consumer.partitions_for_topic(topic) or ())]

    def end_offsets(self, topic: str) -> dict[int, int]:
        parts = self.partitions(topic)
        return {tp.partition: end for tp, end in self._consumer.end_offsets(parts).items()}

    def group_lag(self, group_id: str, topics: list[str]) -> list[PartitionLag]:
        """Per partition of `topics`: end, committed by `group_id`, and the difference."""
        ends = {topic: self.end_offsets(topic) for topic in topics}
        wanted = [TopicPartition(t, p) for t in topics for p in sorted(ends[t])]
        committed = self._admin.list_group_offsets({group_id: wanted}).get(group_id, {})
        out = []
        for topic in topics:
            for partition, end in sorted(ends[topic].items()):
                meta = committed.get(TopicPartition(topic, partition))
                offset = meta.offset if meta is not None and meta.offset >= 0 else None
                out.append(PartitionLag(topic, partition, end, offset,
                                        max(0, end - (offset or 0))))
        return out

    def close(self) -> None:
        self._consumer.close()
        self._admin.close()
