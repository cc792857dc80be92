"""A user's deletion in the join, on the real broker and real SQL (SQLite and PostgreSQL): what
the join holds of them goes, a session of theirs that arrives late is dropped with the feedback
waiting for it, their later generations are joined as before, tombstones go to the compacted
topics, and the trainer's filter passes over their experiences."""

from __future__ import annotations

import uuid
from datetime import timedelta

import numpy as np
import pytest
from sqlalchemy import select

from bench.feedback import synthetic_session
from ingest import join_store
from ingest.config import JoinSettings, KafkaConfig
from ingest.deletions import Forgotten, UserDeletion, delete_user, list_deletions, open_deletions_db
from ingest.events import ExperienceReady, FeedbackReceived, GenerationLogged, experience_id_for
from ingest.join import Join
from ingest.log import EventProducer, ensure_topics
from ingest.topic_reader import read_all, read_raw
from tests.ingest.conftest import Clock
from tests.ingest.helpers import produce, run_until


def session(generation_id: str, user: str | None, *, session_id: str | None = None,
            seed: int = 0, late: bool = False) -> GenerationLogged:
    made = synthetic_session(generation_id, np.random.default_rng(seed))
    update: dict[str, object] = {"user_id": user, "session_id": session_id}
    if not late:  # generated a minute ago, well before the deletion
        update["created_at"] = made.created_at - timedelta(minutes=1)
    return made.model_copy(update=update)


def feedback(generation_id: str) -> FeedbackReceived:
    return FeedbackReceived(event_id=f"e-{uuid.uuid4().hex}", generation_id=generation_id,
                            kind="accept")


def verdict(session_id: str) -> FeedbackReceived:
    return FeedbackReceived(event_id=f"v-{uuid.uuid4().hex}", session_id=session_id,
                            kind="reject", schema_version=2)


@pytest.fixture
def compacted(kafka: KafkaConfig) -> KafkaConfig:
    """`kafka` with its sessions, feedback and experiences topics created compacted."""
    suffix = uuid.uuid4().hex[:8]
    topics = kafka.topics.model_copy(update={
        "sessions": f"sessions-c-{suffix}", "feedback": f"feedback-c-{suffix}",
        "experiences": f"experiences-c-{suffix}"})
    topics = topics.model_copy(update={
        "compacted": [topics.sessions, topics.feedback, topics.experiences]})
    config = kafka.model_copy(update={"topics": topics})
    ensure_topics(config)
    return config


@pytest.mark.parametrize("database_url", ["sqlite", "postgres"], indirect=True)
def test_a_deleted_users_untrained_data_is_forgotten(
        compacted: KafkaConfig, database_url: str, clock: Clock) -> None:
    kafka = compacted
    producer = EventProducer(kafka)
    joined, waiting, kept = session("g-a1", "alice"), session("g-a2", "alice", seed=1), \
        session("g-b1", "bob", seed=2)
    agent_turn = session("g-a3", "alice", session_id="s-alice", seed=3)
    joined_fb, waiting_fb, kept_fb = feedback("g-a1"), feedback("g-a2"), feedback("g-b1")
    on_session = verdict("s-alice")
    # g-a2's feedback waits: its session is not logged yet
    produce(producer, kafka, joined, kept, agent_turn, joined_fb, kept_fb, waiting_fb, on_session)
    join = Join(kafka, JoinSettings(group_id=f"join-{uuid.uuid4().hex[:8]}", poll_timeout_ms=100,
                                    session_settle_s=3600),  # the verdict stays pending
                database_url=database_url, clock=clock)
    run_until(join, lambda: join.stats.experiences == 2 and join.stats.verdicts == 1)

    app_db = open_deletions_db(database_url)  # the app's tables beside the join's
    forgotten = Forgotten(app_db)
    forgotten.refresh()
    made = {x.generation_id: x for x in read_all(kafka, kafka.topics.experiences,
                                                 ExperienceReady)}
    assert made["g-a1"].user_id == "alice" and not forgotten(made["g-a1"])

    record = delete_user(app_db, join.db, "alice", reason="asked", kafka=kafka)
    assert (record.sessions, record.feedback, record.verdicts) == (2, 0, 1)
    assert record.completed_at is not None and record.reason == "asked"
    # the trainer passes over the experience already made of alice's generation
    forgotten.refresh()
    assert forgotten(made["g-a1"]) and not forgotten(made["g-b1"])

    # alice's late session (generated before the deletion) is dropped with what waited for it;
    # her next generation is new data, joined as before
    later = session("g-a4", "alice", seed=4, late=True)
    later_fb = feedback("g-a4")
    produce(producer, kafka, waiting, later, later_fb)
    run_until(join, lambda: join.stats.experiences == 3)
    assert join.stats.forgotten == 1
    with join.db.connect() as conn:
        states = dict(conn.execute(select(join_store.JoinFeedback.event_id,  # type: ignore[call-overload]
                                          join_store.JoinFeedback.state)).all())
        stored = set(conn.execute(select(join_store.JoinSession.generation_id)).scalars())
        users = set(conn.execute(select(join_store.JoinSessionUser.generation_id)).scalars())
        verdict_state = conn.execute(select(join_store.JoinVerdict.state)).scalar()
    assert states[waiting_fb.event_id] == join_store.DELETED
    assert stored == {"g-b1", "g-a4"} and users == {"g-b1", "g-a4"}
    assert verdict_state == join_store.DELETED
    new = {x.generation_id: x for x in read_all(kafka, kafka.topics.experiences,
                                                ExperienceReady)}
    assert set(new) == {"g-a1", "g-b1", "g-a4"} and not forgotten(new["g-a4"])

    # tombstones: every key of alice's the join knew, on each compacted topic
    tombstones = {(topic, key) for topic in (kafka.topics.sessions, kafka.topics.feedback,
                                             kafka.topics.experiences)
                  for key, value in read_raw(kafka, topic) if value == b""}
    assert tombstones == {
        (kafka.topics.sessions, b"g-a1"), (kafka.topics.sessions, b"g-a3"),
        (kafka.topics.feedback, b"g-a1"), (kafka.topics.feedback, b"g-a3"),
        (kafka.topics.feedback, b"s-alice"),
        (kafka.topics.experiences, experience_id_for(joined_fb.event_id).encode())}
    assert record.tombstones == len(tombstones)
    assert join.stats.dead_letters == 0  # the tombstones the join read are not events

    # a second deletion forgets what she did since, and nothing twice
    again = delete_user(app_db, join.db, "alice", kafka=kafka)
    assert (again.sessions, again.feedback, again.verdicts, again.tombstones) == (1, 0, 0, 3)
    forgotten.refresh()
    assert forgotten(new["g-a4"])
    assert [d.id for d in list_deletions(app_db)] == [again.id, record.id]
    assert isinstance(again, UserDeletion)
    producer.close()
    join.close()
    app_db.dispose()
