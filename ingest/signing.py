"""Webhook signatures, Stripe-style: `Flywheel-Signature: t=<unix seconds>,v1=<hex>[,v1=<hex>]`.

Each `v1` is HMAC-SHA256(secret, f"{t}." + body) in hex. A request verifies when its timestamp
lies within the replay window and any `v1` matches any active secret, so secrets rotate by
adding the new one, moving senders over, then removing the old one. Clients, tests and the
bench sign with `sign`; the webhook checks with `verify`.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Sequence

SIGNATURE_HEADER = "Flywheel-Signature"
SCHEME = "v1"
MAX_TIMESTAMP = 10**11  # unix seconds, year 5138: anything later is not a clock reading


class SignatureError(ValueError):
    """A request whose signature header is missing, unreadable, stale or matches no secret."""


def signature(secret: str, timestamp: int, body: bytes) -> str:
    """The hex HMAC-SHA256 of `f"{timestamp}."` + body under `secret`."""
    mac = hmac.new(secret.encode("utf-8"), f"{timestamp}.".encode("ascii"), hashlib.sha256)
    mac.update(body)
    return mac.hexdigest()


def sign(secret: str | Sequence[str], timestamp: int | None, body: bytes) -> str:
    """The `Flywheel-Signature` header value for `body`; one `v1` per secret given."""
    ts = int(time.time()) if timestamp is None else int(timestamp)
    secrets = [secret] if isinstance(secret, str) else list(secret)
    return ",".join([f"t={ts}"] + [f"{SCHEME}={signature(s, ts, body)}" for s in secrets])


def parse_header(header: str) -> tuple[int, list[str]]:
    """Split a header into its timestamp and its `v1` signatures (other schemes are ignored)."""
    timestamp: int | None = None
    signatures: list[str] = []
    for part in header.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep:
            continue
        if name == "t":
            try:
                timestamp = int(value)
            except ValueError as exc:
                raise SignatureError(f"timestamp {value[:32]!r} is not an integer") from exc
            if not 0 <= timestamp <= MAX_TIMESTAMP:
                raise SignatureError("timestamp is not unix seconds")
        elif name == SCHEME:
            signatures.append(value)
    if timestamp is None:
        raise SignatureError("signature header has no t=<timestamp>")
    if not signatures:
        raise SignatureError(f"signature header has no {SCHEME}=<signature>")
    return timestamp, signatures


def verify(header: str | None, body: bytes, secrets: Sequence[str], *, tolerance_s: float,
           now: float | None = None) -> int:
    """Check `header` against `body`; return its timestamp or raise `SignatureError`."""
    if not header:
        raise SignatureError(f"missing {SIGNATURE_HEADER} header")
    timestamp, candidates = parse_header(header)
    age = (time.time() if now is None else now) - timestamp
    if abs(age) > tolerance_s:
        raise SignatureError(f"timestamp is {age:.0f}s from now, outside the "
                             f"{tolerance_s:.0f}s replay window")
    for secret in secrets:
        expected = signature(secret, timestamp, body)
        if any(hmac.compare_digest(expected, c) for c in candidates):
            return timestamp
    raise SignatureError("no signature matches an active secret")
