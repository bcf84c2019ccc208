"""Sealed and signed values in the dist transport's rendezvous store (dist_plan.py names the keys).

The store (a TCPStore on the learner's rank 0) answers anyone who reaches its port: any such client can read,
list, write, pop and delete its keys. So every value says who wrote it, and a side accepts only what it can check:

- requests (producers -> learner) are sealed with an HMAC-SHA256 under the run learner's secret:
      value = b"ra1 " + hex HMAC-SHA256(secret, b"ra1\n" + store key + b"\n" + payload) + b" " + payload
- what the learner writes (its marker, plans, refusals) is signed with its Ed25519 key:
      value = b"rs1 " + hex Ed25519 signature(b"rs1\n" + store key + b"\n" + payload) + b" " + payload

Both cover the store key, so a value moved to another key (another member's plan, an older request number) does
not open. "ra1"/"rs1" are the formats' versions: a value in another format is refused, never guessed at.

The secret: 32 random bytes made by each learner process (DistPublisher) and sent to the producers only inside the
weight announcement (WeightAnnouncement.key, hex), which travels learner -> buffer -> producers over the buffer's
authenticated channel (pipeline/auth.py). It is never written to the store, a log or a metric. Whoever holds it
(every producer) can seal requests; a client of the store alone cannot. The signing key never leaves the learner
process; its public half travels in the announcement (WeightAnnouncement.signer). So a producer, which holds the
secret, still cannot write a plan another producer believes: a compromised producer cannot steer the others'
weights (a plan names each bucket's digest).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

FORMAT = b"ra1"
SIGNED = b"rs1"
SECRET_BYTES = 32
_MAC_HEX = 2 * hashlib.sha256().digest_size
_SIG_HEX = 2 * 64  # an Ed25519 signature
_PUBLIC_BYTES = 32


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def _announced(value: str, size: int, field: str) -> bytes:
    """The `size` bytes that announcement field `field` holds in hex; ValueError if it holds none (or not ours)."""
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raw = b""
    if len(raw) != size:
        raise ValueError(f"the dist weight announcement carries no valid {field} (WeightAnnouncement.{field}): the "
                         "learner predates signed weight plans, or the announcement was not the learner's; run the "
                         "same version of reinforce-ada on the learner and the producers")
    return raw


def secret_from_hex(key: str) -> bytes:
    """The secret an announcement carries; ValueError if it carries none (or not one of ours)."""
    return _announced(key, SECRET_BYTES, "key")


def _message(fmt: bytes, key: str, payload: bytes) -> bytes:
    """What a MAC or signature covers: the format, the store key and the payload."""
    return fmt + b"\n" + key.encode() + b"\n" + payload


def _value(fmt: bytes, tag: bytes, payload: bytes) -> bytes:
    return fmt + b" " + tag + b" " + payload


def _split(raw: bytes, fmt: bytes, tag_hex: int) -> tuple[bytes, bytes] | None:
    """(tag, payload) of a value in format `fmt` whose tag has `tag_hex` characters; None for any other value."""
    got, tag, payload = ([*raw.split(b" ", 2), b"", b""])[:3]
    return (tag, payload) if got == fmt and len(tag) == tag_hex else None


def _mac(secret: bytes, key: str, payload: bytes) -> bytes:
    return hmac.new(secret, _message(FORMAT, key, payload), hashlib.sha256).hexdigest().encode()


def seal(secret: bytes, key: str, payload: bytes) -> bytes:
    """`payload` as the value of store key `key`, with its MAC."""
    return _value(FORMAT, _mac(secret, key, payload), payload)


def open_sealed(secret: bytes, key: str, raw: bytes) -> bytes:
    """The payload of `raw`, read at store key `key`; ValueError if it is not sealed with `secret` for `key`."""
    parts = _split(raw, FORMAT, _MAC_HEX)
    if parts is None:
        raise ValueError(f"store value at {key!r} is not sealed (format {FORMAT.decode()}); someone other than "
                         "the learner or a producer of this run wrote it")
    mac, payload = parts
    if not hmac.compare_digest(mac, _mac(secret, key, payload)):
        raise ValueError(f"store value at {key!r} has a bad signature; it was not written by the learner or a "
                         "producer of this run (or it belongs to another key or learner process)")
    return payload


# ---------------------------------------------------------------- the learner's signature


def new_signing_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def public_hex(signing_key: Ed25519PrivateKey) -> str:
    """The public half of `signing_key`, as WeightAnnouncement.signer carries it."""
    return signing_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def verifier_from_hex(signer: str) -> Ed25519PublicKey:
    """The learner's public key an announcement carries; ValueError if it carries none (or not one of ours)."""
    return Ed25519PublicKey.from_public_bytes(_announced(signer, _PUBLIC_BYTES, "signer"))


def sign(signing_key: Ed25519PrivateKey, key: str, payload: bytes) -> bytes:
    """`payload` as the value of store key `key`, signed by the learner."""
    return _value(SIGNED, signing_key.sign(_message(SIGNED, key, payload)).hex().encode(), payload)


def open_signed(verifier: Ed25519PublicKey, key: str, raw: bytes) -> bytes:
    """The payload of `raw`, read at store key `key`; ValueError unless the learner signed it for `key`."""
    parts = _split(raw, SIGNED, _SIG_HEX)
    if parts is None:
        raise ValueError(f"store value at {key!r} is not signed (format {SIGNED.decode()}); someone other than "
                         "the learner wrote it")
    sig, payload = parts
    try:
        verifier.verify(bytes.fromhex(sig.decode("ascii")), _message(SIGNED, key, payload))
    except (InvalidSignature, ValueError, UnicodeDecodeError):
        raise ValueError(f"store value at {key!r} has a bad signature; the learner that made this announcement "
                         "did not write it (a producer or a store client did, or it belongs to another key)") from None
    return payload
