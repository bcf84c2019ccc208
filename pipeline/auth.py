"""Who may talk to the buffer, and as what: CurveZMQ keys per role, and the learner's token on loopback.

A connection to the buffer holds one of two roles. A *producer* asks for rounds and sends results and heartbeats,
and the buffer takes its results only for rounds it leased to that very connection. The *learner* may also take
batches, announce versions and weights, and stop the run. The buffer learns a connection's role when it connects,
never from a message:
- with CurveZMQ keys (endpoints.keys_dir): from the key it authenticated with. `reinforce-ada keys` makes a server
  key and one key pair per role; `authorized/producer/` and `authorized/learner/` hold the public keys admitted in
  each role, and the ZAP handler (`RoleAuthenticator`) gives every connection the User-Id
  "<role>:<z85 public key>", which the buffer reads off each received frame;
- on loopback without keys (parts started by hand: `reinforce-ada train` makes every run keys of its own, with a
  key per producer): the learner presents the run's secret token (`run_dir/learner.token`, mode 0600, made by
  `reinforce-ada keys --learner-token`) as ZMTP handshake metadata (`TOKEN_PROPERTY`); every other connection is a
  producer. Without a token file every local connection is trusted as the learner (a buffer started alone).

Key directory layout (`make_keys`):
    server.key, server.key_secret          the buffer's pair (the public half goes to every machine)
    producer.key, producer.key_secret      the producers' pair (producer machines)
    learner.key, learner.key_secret        the learner's pair (the learner's machine only)
    NAME.key, NAME.key_secret              with `make_keys(dir, producers)`: producer NAME's own pair, in place of
                                           the shared producer pair (a run's own keys; `reinforce-ada keys
                                           --producer NAME`); `add_producer_keys` adds one to a directory
    authorized/producer/*.key              public keys admitted as producers
    authorized/learner/*.key               public keys admitted as the learner

Invariants: a secret key or the token never travels in a message or on a command line; a key file or token the
buffer cannot read fully and exactly is a startup error naming the file, never a silently empty allow-list.
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
import shutil
import stat
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

PRODUCER = "producer"
LEARNER = "learner"
ROLES = (PRODUCER, LEARNER)
SERVER_KEY = "server"
OLD_CLIENT_KEY = "client"  # the layout before roles: one client key for every role
TOKEN_FILE = "learner.token"
TOKEN_PROPERTY = "X-Learner-Token"  # ZMTP metadata property that carries the token (ZMQ_METADATA)
_TOKEN_RE = re.compile(r"[0-9a-f]{32,128}")
_KEY_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")  # a client's own key file name (its producer id)
MAKE_KEYS = "reinforce-ada keys --out KEYS_DIR"


class SecurityError(ValueError):
    """A bind, connect or credential that would expose the pipeline, or that cannot be used as it is."""


# ---------------------------------------------------------------- CurveZMQ keys


def _check_producer_names(producers: tuple[str, ...] | list[str]) -> None:
    bad = [p for p in producers if not _KEY_NAME_RE.fullmatch(p) or p in (SERVER_KEY, LEARNER)]
    if bad:
        raise SecurityError(f"producer names {bad} cannot name key files: use letters, digits, '.', '_' and '-' "
                            f"(and neither {SERVER_KEY!r} nor {LEARNER!r})")
    if len(set(producers)) != len(producers):
        raise SecurityError(f"producer names {sorted(producers)} repeat a name: each producer needs its own")


def _create_pairs(root: Path, names: list[str], role_of: dict[str, str]) -> None:
    """A key pair per name under `root` (secret halves never readable by others), each public half admitted in
    its role under authorized/ (names absent from `role_of` are not admitted: the server's)."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    umask = os.umask(0o077)  # a secret key is never readable by others, not even between its write and a chmod
    try:
        for name in names:
            zmq.auth.create_certificates(root, name)
            (root / f"{name}.key").chmod(0o644)
    finally:
        os.umask(umask)
    for role in ROLES:
        (root / "authorized" / role).mkdir(parents=True, exist_ok=True)
    for name, role in role_of.items():
        shutil.copy(root / f"{name}.key", root / "authorized" / role / f"{name}.key")


def make_keys(keys_dir: str | os.PathLike, producers: tuple[str, ...] | list[str] = ()) -> Path:
    """Create the server pair and one pair per role under `keys_dir`, each public key admitted in its role. With
    `producers` (their --id names), each of them gets a pair of its own instead of the one producer pair (a
    producer presents `<id>.key_secret` when there is one, see `client_key_name`), so that each is one client."""
    root = Path(keys_dir)
    _check_producer_names(producers)
    if (root / f"{OLD_CLIENT_KEY}.key_secret").exists() or (root / "authorized" / f"{OLD_CLIENT_KEY}.key").exists():
        raise SecurityError(f"{root} holds keys of the old layout (one client key for every role): make the new "
                            "keys in an empty directory and replace the old one on every machine")
    role_of = {LEARNER: LEARNER, **{name: PRODUCER for name in (list(producers) or [PRODUCER])}}
    _create_pairs(root, [SERVER_KEY, *role_of], role_of)
    return root


def add_producer_keys(keys_dir: str | os.PathLike, producers: list[str]) -> Path:
    """Add a key pair of its own for each producer in `producers` to an existing key directory, admitted as a
    producer; the server's and everyone else's keys stay as they are (a running buffer admits them once
    restarted). A name that has a key already is refused: replacing it would lock out the machine holding it."""
    root = Path(keys_dir)
    if not (root / f"{SERVER_KEY}.key_secret").is_file():
        raise SecurityError(f"{root} holds no server key: make the keys first with `reinforce-ada keys --out {root}`")
    _check_producer_names(producers)
    taken = [name for name in producers if (root / f"{name}.key").exists()]
    if taken:
        raise SecurityError(f"{root} holds keys for {taken} already: pick new producer names (a producer's --id "
                            "names its key), or delete those key files and authorized/producer/ entries first")
    _create_pairs(root, list(producers), dict.fromkeys(producers, PRODUCER))
    return root


def supervisor_role(keys_dir: str | os.PathLike) -> str:
    """The role `train`'s supervisor asks for metrics in: the learner's, whose key it holds on the learner's machine
    (a run's own keys have no shared producer key), else a producer's."""
    return LEARNER if keys_dir and (Path(keys_dir) / f"{LEARNER}.key_secret").is_file() else PRODUCER


def client_key_name(keys_dir: str | os.PathLike, role: str, identity: str = "") -> str:
    """The key pair a client presents: a producer's own (`<its id>.key_secret`) when `keys_dir` has one, else its
    role's."""
    if role == PRODUCER and _KEY_NAME_RE.fullmatch(identity) and identity not in (SERVER_KEY, LEARNER) and \
            (Path(keys_dir) / f"{identity}.key_secret").is_file():
        return identity
    return role


def _old_layout(root: Path) -> SecurityError:
    return SecurityError(
        f"{root} holds CurveZMQ keys of the old layout (one client key for every role, so any producer could act "
        f"as the learner). Make new keys with `reinforce-ada keys --out NEW_DIR` (a server key and one key per "
        "role), give producer machines server.key and producer.key*, the learner's machine server.key and "
        "learner.key*, and set endpoints.keys_dir = NEW_DIR everywhere")


def load_pair(keys_dir: str | os.PathLike, name: str) -> tuple[bytes, bytes]:
    """The (public, secret) key pair `name` ("server" or a role) from `keys_dir`; SecurityError naming the fix."""
    root = Path(keys_dir)
    path = root / f"{name}.key_secret"
    if not path.is_file():
        if (root / f"{OLD_CLIENT_KEY}.key_secret").is_file():
            raise _old_layout(root)
        raise SecurityError(f"missing CurveZMQ key {path}: `{MAKE_KEYS}` makes it; copy {name}.key_secret (and "
                            "server.key) to this machine")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:  # whoever reads it can act as this role (the learner's: take batches, stop the run)
        raise SecurityError(f"secret key {path} has mode {mode:04o}: other users may read it and act as "
                            f"{name}; make it readable only by you: chmod 600 {path}")
    public, secret = _read_key(path, secret=True)
    assert secret is not None
    return public, secret


def server_public_key(keys_dir: str | os.PathLike) -> bytes:
    path = Path(keys_dir) / f"{SERVER_KEY}.key"
    if not path.is_file():
        raise SecurityError(f"missing server public key {path}; copy it from the buffer's keys_dir")
    return _read_key(path)[0]


def _read_key(path: Path, secret: bool = False) -> tuple[bytes, bytes | None]:
    """A certificate's z85 keys, each checked to be a 32-byte CurveZMQ key; SecurityError naming the file."""
    try:
        public, secret_key = zmq.auth.load_certificate(path)
        keys = [public, secret_key] if secret else [public]
        if any(k is None or len(z85.decode(k)) != 32 for k in keys):
            raise ValueError("not a 32-byte z85 key")
    except (OSError, ValueError) as exc:
        raise SecurityError(f"{path} is not a readable CurveZMQ {'secret' if secret else 'public'} key ({exc}); "
                            f"replace it with one made by `{MAKE_KEYS}`") from None
    return public, secret_key


def authorized_keys(keys_dir: str | os.PathLike) -> dict[bytes, str]:
    """Every admitted public key (z85) with its role, from `keys_dir/authorized/<role>/`. Any file there that is not
    a readable public key, a key admitted in both roles, or a role without any key is a SecurityError."""
    root = Path(keys_dir)
    admitted_dir = root / "authorized"
    if not admitted_dir.is_dir():
        raise SecurityError(f"{admitted_dir} is missing: it holds the public keys of the clients admitted in each "
                            f"role; `{MAKE_KEYS}` makes it")
    roles: dict[bytes, str] = {}
    for entry in sorted(admitted_dir.iterdir()):
        if entry.name not in ROLES or not entry.is_dir():
            if entry.suffix == ".key":
                raise _old_layout(root)
            raise SecurityError(f"{entry}: authorized/ holds only the folders {' and '.join(ROLES)} (public keys "
                                "admitted in each role); move it away")
        for path in sorted(entry.iterdir()):
            key = _read_key(path)[0]
            if roles.get(key, entry.name) != entry.name:
                raise SecurityError(f"{path}: this public key is admitted as {roles[key]} too; a key holds one role")
            roles[key] = entry.name
    for role in ROLES:
        if role not in roles.values():
            raise SecurityError(f"{admitted_dir / role} admits no key, so no {role} could connect; copy "
                                f"{role}.key there (`{MAKE_KEYS}` does)")
    return roles


class RoleAuthenticator(ThreadAuthenticator):
    """pyzmq's ZAP handler (in a thread) admitting exactly the keys of `roles`, and naming every connection
    "<role>:<z85 public key>" in its ZAP User-Id (received frames carry it as `frame.get("User-Id")`)."""

    def __init__(self, ctx: zmq.Context, roles: dict[bytes, str]) -> None:
        super().__init__(ctx)
        self.roles = dict(roles)
        # set directly: configure_curve(location=...) logs an unreadable key file and then admits no one
        self.certs["*"] = dict.fromkeys(self.roles, True)

    def curve_user_id(self, client_public_key: bytes) -> str:
        key = z85.encode(client_public_key)
        return f"{self.roles[key]}:{key.decode('ascii')}"


# ---------------------------------------------------------------- the learner token (loopback without keys)


def learner_token_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / TOKEN_FILE


def create_token(path: str | os.PathLike) -> Path:
    """Write a fresh learner token to `path`, replacing an older one: created with O_EXCL | O_NOFOLLOW (never
    through a file or link already there) and mode 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def read_token(path: str | os.PathLike) -> str | None:
    """The token in `path`, or None when there is no such file. SecurityError (naming the file and the fix) for a
    link, a file another user owns or may read, or one that holds no token."""
    path = Path(path)
    fix = f"delete it (`reinforce-ada train` makes a new one, `reinforce-ada keys --learner-token {path}` too)"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SecurityError(f"cannot read the learner token {path} ({exc}; a link is refused): {fix}") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise SecurityError(f"the learner token {path} must be a regular file of this user with mode 0600 (it is "
                                f"{stat.filemode(st.st_mode)}, uid {st.st_uid}): {fix}")
        token = f.read(256).strip()
    if not _TOKEN_RE.fullmatch(token):
        raise SecurityError(f"{path} holds no learner token: {fix}")
    return token


def token_metadata(token: str) -> bytes:
    """The ZMQ_METADATA option value that presents `token` in the handshake of every connection of a socket."""
    return f"{TOKEN_PROPERTY}:{token}".encode()


class ConnectionRoles:
    """The role (and User-Id) of the connection a received frame came on; see the module docstring.

    Modes: "curve" (the ZAP User-Id), "token" (the learner presents the token, everyone else is a producer),
    "open" (loopback without a token file: everyone is trusted as the learner).
    """

    def __init__(self, curve: bool, token: str | None) -> None:
        self.mode = "curve" if curve else "token" if token else "open"
        self._token = token.encode() if token else b""

    def of(self, frame: zmq.Frame) -> tuple[str, str]:
        """(role, user) of `frame`'s connection; user is the ZAP User-Id under CurveZMQ, else ""."""
        if self.mode == "open":
            return LEARNER, ""
        name = "User-Id" if self.mode == "curve" else TOKEN_PROPERTY
        try:
            value = frame.get(name)
        except zmq.ZMQError:  # the connection carries no such property
            return PRODUCER, ""
        if self.mode == "curve":
            role = value.partition(":")[0]
            return (role if role in ROLES else PRODUCER), value
        presented = value.encode() if isinstance(value, str) else bytes(value)
        return (LEARNER if hmac.compare_digest(presented, self._token) else PRODUCER), ""
