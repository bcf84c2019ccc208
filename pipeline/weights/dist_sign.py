"""Signed values in the dist transport's rendezvous store (dist_plan.py names the keys).

The store (a TCPStore on the learner's rank 0) answers anyone who reaches its port: any such client can read,
list, write, pop and delete its keys. So every request and plan is sealed with an HMAC-SHA256 under the run
learner's secret, and a side accepts only what it can open:

    value = b"ra1 " + hex HMAC-SHA256(secret, b"ra1\\n" + store key + b"\\n" + payload) + b" " + payload

The MAC covers the store key, so a value moved to another key (another member's plan, an older request number)
does not open. "ra1" is the format's version: a value in another format is refused, never guessed at.

The secret: 32 random bytes made by each learner process (DistPublisher) and sent to the producers only inside the
weight announcement (WeightAnnouncement.key, hex), which travels learner -> buffer -> producers over the buffer's
authenticated channel (pipeline/auth.py). It is never written to the store, a log or a metric. Whoever holds it
(every producer) can seal values; a client of the store alone cannot.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

FORMAT = b"ra1"
SECRET_BYTES = 32
_MAC_HEX = 2 * hashlib.sha256().digest_size


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def secret_from_hex(key: str) -> bytes:
    """The secret an announcement carries; ValueError if it carries none (or not one of ours)."""
    try:
        secret = bytes.fromhex(key)
    except ValueError:
        secret = b""
    if len(secret) != SECRET_BYTES:
        raise ValueError("the dist weight announcement carries no valid key (WeightAnnouncement.key): the learner "
                         "predates signed weight plans, or the announcement was not the learner's; run the same "
                         "version of reinforce-ada on the learner and the producers")
    return secret


def _mac(secret: bytes, key: str, payload: bytes) -> bytes:
    return hmac.new(secret, FORMAT + b"\n" + key.encode() + b"\n" + payload, hashlib.sha256).hexdigest().encode()


def seal(secret: bytes, key: str, payload: bytes) -> bytes:
    """`payload` as the value of store key `key`, with its MAC."""
    return FORMAT + b" " + _mac(secret, key, payload) + b" " + payload


def open_sealed(secret: bytes, key: str, raw: bytes) -> bytes:
    """The payload of `raw`, read at store key `key`; ValueError if it is not sealed with `secret` for `key`."""
    fmt, mac, payload = ([*raw.split(b" ", 2), b"", b""])[:3]
    if fmt != FORMAT or len(mac) != _MAC_HEX:
        raise ValueError(f"store value at {key!r} is not sealed (format {FORMAT.decode()}); someone other than "
                         "the learner or a producer of this run wrote it")
    if not hmac.compare_digest(mac, _mac(secret, key, payload)):
        raise ValueError(f"store value at {key!r} has a bad signature; it was not written by the learner or a "
                         "producer of this run (or it belongs to another key or learner process)")
    return payload
