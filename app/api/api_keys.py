"""Inference keys: who may call `/v1`, as which user, how often.

A key reads `fwk-<key_id>.<secret>`: the key id is public (listed, logged, revoked by), the
secret is 32 random bytes shown once, when the key is made, and stored only as its sha256 (a
random secret needs no slow hash: nothing to guess from a leaked table). Each key speaks for one
user id, which becomes the `user_id` every generation made with it is logged under, whatever
the request body's `user` says.

`KeyCheck` answers per request from memory: a key's row is read from SQL at most once per
`RECHECK_S` (so a revoked key stops working within that, on every replica sharing the
database), and a key with a rate limit has a token bucket in this process (a limit per API
replica) answered with 429 and `Retry-After`. Any `KeyChecker` can stand in for it: the
rollout worker's endpoint (app/rollouts/endpoint.py) checks its episodes' keys, which live as
long as their episode, from memory with no table.

    key, secret = create_key(db, user_id="u-17", rps=5.0)   # the admin API, the CLI
    caller = checker.check(authorization_header)             # ApiKeyError: 401 or 429
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from sqlalchemy import Engine
from sqlmodel import Session, select

from app.db import ApiKey
from ingest.events import utcnow

PREFIX = "fwk-"
RECHECK_S = 0.5  # a revocation reaches every replica within this (a duration: that is the promise)


class ApiKeyError(Exception):
    """A request the keys refuse: `status` 401 (no key, unknown, revoked) or 429 (over its
    rate, `retry_after_s`)."""

    def __init__(self, status: int, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after_s = status, message, retry_after_s


@dataclass(frozen=True)
class Caller:
    """Who a request comes from: its key and the user it speaks for."""

    key_id: str
    user_id: str
    private: bool = False  # the key's requests are all in privacy mode


def secret_sha256(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create_key(db: Engine, *, user_id: str, rps: float | None = None,
               label: str | None = None, private: bool = False) -> tuple[ApiKey, str]:
    """A new key for `user_id` (`private`: every request in privacy mode): its row and the
    whole key, which nothing keeps."""
    key_id, secret, key = new_key()
    row = ApiKey(key_id=key_id, secret_sha256=secret_sha256(secret), user_id=user_id, rps=rps,
                 label=label, private=private)
    with Session(db) as session:
        session.add(row)
        session.commit()
        session.refresh(row)
    return row, key


def list_keys(db: Engine) -> list[ApiKey]:
    with Session(db) as session:
        return list(session.exec(select(ApiKey).order_by(ApiKey.created_at)))  # type: ignore[arg-type]


def revoke_key(db: Engine, key_id: str) -> ApiKey | None:
    """Revoke `key_id` (once: a second revocation keeps the first time); None if unknown."""
    with Session(db) as session:
        row = session.get(ApiKey, key_id)
        if row is None:
            return None
        if row.revoked_at is None:
            row.revoked_at = utcnow()
            session.add(row)
            session.commit()
            session.refresh(row)
        return row


def parse_key(key: str) -> tuple[str, str] | None:
    """(key_id, secret) of a well-formed key, else None."""
    if not key.startswith(PREFIX) or "." not in key:
        return None
    key_id, _, secret = key[len(PREFIX):].partition(".")
    return (key_id, secret) if key_id and secret else None


def bearer_key(authorization: str | None) -> tuple[str, str] | None:
    """(key_id, secret) of an `Authorization: Bearer <key>` header's well-formed key, None for
    a malformed key; ApiKeyError (401) when the header carries no bearer key at all."""
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiKeyError(401, "an inference key is required: Authorization: Bearer "
                          "<key> (the OpenAI clients send their api_key so)")
    return parse_key(key.strip())


def new_key() -> tuple[str, str, str]:
    """A fresh key: its id, its secret and the whole key the caller is given."""
    key_id, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
    return key_id, secret, f"{PREFIX}{key_id}.{secret}"


class KeyChecker(Protocol):
    """Who a request's `Authorization` header speaks for; ApiKeyError (401, 429) if no one."""

    def check(self, authorization: str | None) -> Caller: ...


class _Bucket:
    """A token bucket of `rate` per second holding at most max(1, rate)."""

    def __init__(self, rate: float) -> None:
        self.rate, self.capacity = rate, max(1.0, rate)
        self.tokens, self.at = self.capacity, time.monotonic()

    def take(self) -> float:
        """0.0 when a request may go now (one token taken), else seconds until it may."""
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class KeyCheck:
    """Checks `Authorization` headers against the keys table, from memory between reads."""

    def __init__(self, db: Engine, recheck_s: float = RECHECK_S) -> None:
        self.db, self.recheck_s = db, recheck_s
        self._rows: dict[str, tuple[float, ApiKey | None]] = {}  # key_id -> (read at, row)
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    def check(self, authorization: str | None) -> Caller:
        parsed = bearer_key(authorization)
        row = self._row(parsed[0]) if parsed else None
        if parsed is None or row is None or not hmac.compare_digest(
                row.secret_sha256, secret_sha256(parsed[1])):
            raise ApiKeyError(401, "the inference key is not valid")
        if row.revoked_at is not None:
            raise ApiKeyError(401, f"the inference key {row.key_id} was revoked")
        if row.rps is not None:
            wait = self._bucket(row).take()
            if wait > 0:
                raise ApiKeyError(429, f"the inference key {row.key_id} is limited to "
                                  f"{row.rps:g} requests per second",
                                  retry_after_s=max(1, math.ceil(wait)))
        return Caller(key_id=row.key_id, user_id=row.user_id, private=row.private)

    def _row(self, key_id: str) -> ApiKey | None:
        now = time.monotonic()
        with self._lock:
            cached = self._rows.get(key_id)
        if cached is not None and now - cached[0] < self.recheck_s:
            return cached[1]
        with Session(self.db) as session:
            row = session.get(ApiKey, key_id)
            if row is not None:
                session.expunge(row)
        with self._lock:
            self._rows[key_id] = (now, row)
        return row

    def _bucket(self, row: ApiKey) -> _Bucket:
        assert row.rps is not None
        with self._lock:
            bucket = self._buckets.get(row.key_id)
            if bucket is None or bucket.rate != row.rps:
                bucket = self._buckets[row.key_id] = _Bucket(row.rps)
            return bucket
