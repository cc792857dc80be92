"""`flywheel keys` and `flywheel users`: who may call /v1, and deleting a user's data; on the
databases directly, under the admin API's rules (its request models)."""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from app.settings import Settings


def keys(args: argparse.Namespace, settings: Settings) -> int:
    """`flywheel keys`: on the SQL database the API reads keys from (FLYWHEEL_DATABASE_URL)."""
    from app.api.api_keys import create_key, list_keys, revoke_key
    from app.api.schemas import KeyRequest
    from app.db import make_db_engine

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    db = make_db_engine(settings.resolved_database_url)
    try:
        if args.action == "create":
            try:  # the admin API's rules for a new key
                asked = KeyRequest(user_id=args.user, rps=args.rps, label=args.label,
                                   private=args.private)
            except ValidationError as error:
                print(f"flywheel keys create: {error}", file=sys.stderr)
                return 2
            row, key = create_key(db, user_id=asked.user_id, rps=asked.rps, label=asked.label,
                                  private=asked.private)
            print(f"{key}\n(key {row.key_id} for user {row.user_id}: shown this once, only "
                  "its hash is kept)")
        elif args.action == "list":
            for row in list_keys(db):
                state = f"revoked {row.revoked_at:%Y-%m-%d %H:%M:%S}" if row.revoked_at \
                    else "active"
                limit = f"{row.rps:g} rps" if row.rps is not None else "no limit"
                private = "  private" if row.private else ""
                print(f"{row.key_id}  user={row.user_id}  {limit}  {state}{private}  "
                      f"{row.label or ''}")
        else:
            revoked = revoke_key(db, args.key_id)
            if revoked is None:
                print(f"flywheel keys revoke: no key {args.key_id}", file=sys.stderr)
                return 1
            print(f"revoked {revoked.key_id} (user {revoked.user_id})")
    finally:
        db.dispose()
    return 0


def users(args: argparse.Namespace, settings: Settings) -> int:
    """`flywheel users`: on the app's database (FLYWHEEL_DATABASE_URL) and the join's
    (FLYWHEEL_JOIN__DATABASE_URL); tombstones through FLYWHEEL_KAFKA_BOOTSTRAP (or --kafka)
    where topics are compacted."""
    from app.api.schemas import DeletionInfo, DeletionRequest
    from app.db import make_db_engine
    from ingest import join_store
    from ingest.deletions import delete_user, list_deletions
    from ingest.sql import open_database

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    db = make_db_engine(settings.resolved_database_url)
    try:
        if args.action == "deletions":
            for row in list_deletions(db):
                done = f"{row.completed_at:%Y-%m-%d %H:%M:%S}" if row.completed_at \
                    else "not completed (run it again)"
                print(f"{row.id}  user={row.user_id}  asked {row.requested_at:%Y-%m-%d %H:%M:%S}"
                      f"  done {done}  sessions={row.sessions} feedback={row.feedback} "
                      f"verdicts={row.verdicts} tombstones={row.tombstones}  {row.reason}")
            return 0
        try:  # the admin API's rules for a deletion
            asked = DeletionRequest(user_id=args.user, reason=args.reason)
        except ValidationError as error:
            print(f"flywheel users delete: {error}", file=sys.stderr)
            return 2
        bootstrap = args.kafka or settings.kafka_bootstrap
        if settings.topics.compacted and bootstrap is None:
            print("flywheel users delete: topics are compacted "
                  f"({', '.join(settings.topics.compacted)}): give --kafka or "
                  "FLYWHEEL_KAFKA_BOOTSTRAP for their tombstones", file=sys.stderr)
            return 2
        join_db = open_database(settings.resolved_join_database_url, join_store.TABLES)
        try:
            record = delete_user(db, join_db, asked.user_id, requested_by="cli",
                                 reason=asked.reason,
                                 kafka=settings.kafka_config(bootstrap) if bootstrap else None)
        finally:
            join_db.dispose()
        print(DeletionInfo.model_validate(record, from_attributes=True).model_dump_json())
    finally:
        db.dispose()
    return 0
