"""Deleting one user's data: what the join holds, what waits to be trained, and a record of it.

`delete_user` (behind `POST /admin/deletions` and `flywheel users delete`) forgets every
generation the user made up to the moment of the request:

1. it records the deletion (`user_deletion`, in the app's database, which the online trainer
   also reads): from then on the trainer skips the user's experiences generated up to that
   moment, even those already on `experiences` (`Forgotten`), so they never reach its ledger;
2. it deletes what the join holds of them (`forget_user`): stored sessions,
   the feedback pending for them, the verdicts pending on their agent sessions; and the join
   drops a session of theirs that arrives later but was generated before (a lagging log);
3. it writes tombstones for the user's keys (sessions and feedback by generation id, verdicts
   by session id, experiences by experience id) to the topics created compacted
   (`TopicSettings.compacted`; none by default), so compaction removes those records before
   retention would;
4. it completes the record with what it deleted.

Applied again, it finds nothing more and records that. What it cannot undo: weights already
trained on the user's data (a released version, the trainer's checkpoints, the steps of the
ledger that hold their ids) and records still on the topics until their retention (or, on a
compacted topic, compaction) removes them.
The user may go on using the product: generations after the deletion are logged as before
(privacy mode keeps them out of training).
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import NamedTuple

from sqlalchemy import Connection, Engine, delete, func, insert, update
from sqlmodel import Field, Session, SQLModel, col, select

from ingest.config import KafkaConfig
from ingest.events import ExperienceReady, experience_id_for, utcnow
from ingest.join_store import (
    DELETED,
    EXPANDED,
    IS_PENDING,
    MATCHED,
    JoinFeedback,
    JoinForgotten,
    JoinSessionUser,
    JoinVerdict,
    as_utc,
    drop_feedback,
    forget_sessions,
    rows_in,
)
from ingest.log import EventProducer
from ingest.sql import IDS, chunks, open_database


class UserDeletion(SQLModel, table=True):
    """One deletion of one user's data: who asked, when (the generations up to then are
    forgotten), and what was deleted. Kept for good: it is the proof the deletion happened
    and what the trainer's filter reads."""

    __tablename__ = "user_deletion"
    id: int | None = Field(default=None, primary_key=True)
    user_id: str = Field(max_length=128, index=True)
    requested_at: datetime = Field(default_factory=utcnow)
    requested_by: str = Field(default="admin", max_length=128)
    reason: str = Field(default="", max_length=2000)
    completed_at: datetime | None = None  # None: the join's part did not finish (retry)
    sessions: int = 0  # stored sessions the join deleted
    feedback: int = 0  # pending feedback deleted
    verdicts: int = 0  # pending session verdicts deleted
    tombstones: int = 0  # tombstones written to compacted topics


def delete_user(db: Engine, join_db: Engine, user_id: str, *, requested_by: str = "admin",
                reason: str = "", kafka: KafkaConfig | None = None) -> UserDeletion:
    """Forget `user_id`'s generations up to now (module doc); returns the completed record.
    `kafka` None: no tombstones (a caller with no broker, or no compacted topic)."""
    with Session(db) as session:  # first: the trainer's filter holds from this commit on
        record = UserDeletion(user_id=user_id, requested_by=requested_by, reason=reason)
        session.add(record)
        session.commit()
        session.refresh(record)
    before = _unix(record.requested_at)
    with join_db.begin() as conn:
        forgot = forget_user(conn, user_id, before, time.time())
    tombstones = _tombstone(kafka, forgot) if kafka is not None else 0
    with Session(db) as session:
        record.sqlmodel_update({"sessions": forgot.sessions, "feedback": forgot.feedback,
                                "verdicts": forgot.verdicts, "tombstones": tombstones,
                                "completed_at": utcnow()})
        session.add(record)
        session.commit()
        session.refresh(record)
    return record


class Forgot(NamedTuple):
    """What `forget_user` deleted, and the keys the user's records have on the topics."""

    generation_ids: list[str]  # keys on `sessions`, and of feedback about one generation
    session_ids: list[str]  # keys of session verdicts on `feedback`
    experience_ids: list[str]  # keys on `experiences` of what was made of them
    sessions: int  # stored sessions deleted
    feedback: int  # pending feedback deleted
    verdicts: int  # pending session verdicts deleted


def forget_user(conn: Connection, user_id: str, before: float, now: float) -> Forgot:
    """Delete what the join holds of `user_id`'s generations created up to `before` (unix
    seconds): the stored sessions and their index rows, the feedback pending for them, the
    verdicts pending on their agent sessions; and remember the user, so that a session of
    theirs that arrives later is dropped on arrival (`forgotten_among`). Idempotent."""
    rows = conn.execute(select(col(JoinSessionUser.generation_id),
                               col(JoinSessionUser.session_id))
                        .where(col(JoinSessionUser.user_id) == user_id,
                               col(JoinSessionUser.created_at) <= before)).tuples().all()
    generations = sorted({g for g, _ in rows})
    by_session: dict[str, list[str]] = {}
    for g, session_id in rows:
        if session_id is not None:
            by_session.setdefault(session_id, []).append(g)
    matched = rows_in(conn, select(col(JoinFeedback.event_id)).where(
        col(JoinFeedback.state) == MATCHED, col(JoinFeedback.generation_id).in_(IDS)),
        generations)
    expanded = rows_in(conn, select(col(JoinVerdict.event_id), col(JoinVerdict.session_id)).where(
        col(JoinVerdict.state) == EXPANDED, col(JoinVerdict.session_id).in_(IDS)), by_session)
    experiences = [experience_id_for(e) for e, in matched]
    experiences += [experience_id_for(e, g) for e, s in expanded for g in by_session[s]]
    sessions = forget_sessions(conn, generations)
    for chunk in chunks(generations):  # the user index, which expiry keeps, goes too
        conn.execute(delete(JoinSessionUser).where(
            col(JoinSessionUser.generation_id).in_(IDS)), {"ids": chunk})
    feedback = drop_feedback(conn, generations)
    verdicts = len(rows_in(conn, update(JoinVerdict).where(
        IS_PENDING, col(JoinVerdict.session_id).in_(IDS))
        .values(state=DELETED, payload="").returning(col(JoinVerdict.event_id)), by_session))
    remembered = conn.execute(select(col(JoinForgotten.before)).where(
        col(JoinForgotten.user_id) == user_id)).scalar()
    if remembered is None:
        conn.execute(insert(JoinForgotten).values(user_id=user_id, before=before,
                                                  requested_at=now))
    elif before > remembered:
        conn.execute(update(JoinForgotten).where(col(JoinForgotten.user_id) == user_id)
                     .values(before=before, requested_at=now))
    return Forgot(generations, sorted(by_session), experiences, sessions, feedback, verdicts)


def _tombstone(kafka: KafkaConfig, forgot: Forgot) -> int:
    """A tombstone for each of the user's keys on each compacted topic; returns how many."""
    topics = kafka.topics
    keys = {topics.sessions: forgot.generation_ids,
            topics.feedback: forgot.generation_ids + forgot.session_ids,
            topics.experiences: forgot.experience_ids}
    wanted = {topic: keys[topic] for topic in topics.compacted if keys[topic]}
    if not wanted:
        return 0
    producer = EventProducer(kafka, client_id="flywheel-deletion")
    try:
        for topic, topic_keys in wanted.items():
            producer.deliver(topic, [(key, None) for key in topic_keys],
                             timeout_s=kafka.delivery_timeout_ms / 1000)
    finally:
        producer.close()
    return sum(len(k) for k in wanted.values())


def open_deletions_db(url: str) -> Engine:
    """The app's database, with the `user_deletion` table."""
    return open_database(url, [UserDeletion.__table__])  # type: ignore[attr-defined]


def list_deletions(db: Engine, *, limit: int = 100) -> list[UserDeletion]:
    """The most recent deletions first."""
    with Session(db) as session:
        return list(session.exec(select(UserDeletion)
                                 .order_by(col(UserDeletion.id).desc()).limit(limit)).all())


class Forgotten:
    """The online trainer's filter: an experience whose user was deleted after generating it
    is never trained. `refresh` reads the deletions (one small query: the latest per user)."""

    def __init__(self, db: Engine) -> None:
        self.db = db
        self.before: dict[str, float] = {}

    def refresh(self) -> None:
        with Session(self.db) as session:
            rows = session.exec(select(UserDeletion.user_id,
                                       func.max(UserDeletion.requested_at))
                                .group_by(col(UserDeletion.user_id))).all()
        self.before = {user: _unix(at) for user, at in rows}

    def __call__(self, experience: ExperienceReady) -> bool:
        """Whether `experience` is of a deleted user's generation."""
        user = experience.user_id
        return user is not None and user in self.before and \
            _unix(experience.generated_at) <= self.before[user]


def _unix(moment: datetime) -> float:
    return as_utc(moment).timestamp()
