"""Issue #13, the files side: the buffer's snapshot is written through a fresh private temp file (never through a
file or link planted beside it) with its directory synced, stale temp files are pruned at start; the learner
token is private and never read through a link; a keys directory the buffer cannot read fully is a startup error
naming the file, and the old one-client-key layout is refused with the command that replaces it."""

import os
import stat
import subprocess
from pathlib import Path

import pytest
import zmq

from pipeline import protocol as P
from pipeline.auth import (
    LEARNER,
    PRODUCER,
    ConnectionRoles,
    SecurityError,
    authorized_keys,
    create_token,
    learner_token_path,
    load_pair,
    make_keys,
    read_token,
)
from pipeline.buffer.core import BufferCore
from pipeline.config import load_config
from pipeline.testing.processes import buffer_command
from pipeline.transport import BufferClient, ServerSecurity, free_port_pair

REPO = Path(__file__).resolve().parents[1]


def _core(tmp_path, **kw) -> BufferCore:
    cfg = load_config(None, ["--run.dir", str(tmp_path), "--learner.eval_every", "0"])
    return BufferCore(cfg, [("1+1=", "2")], [], now=0.0, **kw)


# ---------------------------------------------------------------- snapshots


def test_snapshots_go_through_a_fresh_private_temp_file_and_a_synced_directory(tmp_path, monkeypatch):
    snap_dir = tmp_path / "tiny" / "buffer"
    snap_dir.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (snap_dir / "snapshot.msgpack.tmp").symlink_to(victim)  # the fixed name older buffers wrote through
    (snap_dir / "snapshot.msgpack.k2j3h4.tmp").write_bytes(b"half a snapshot")  # a buffer killed mid-write
    core = _core(tmp_path)
    assert sorted(p.name for p in snap_dir.iterdir()) == []  # pruned at start: the link removed, not followed
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_mode), real_fsync(fd)))
    assert core.write_snapshot()
    path = core.snapshots.path
    assert [p.name for p in snap_dir.iterdir()] == ["snapshot.msgpack"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and victim.read_text() == "precious"
    assert [stat.S_ISDIR(m) for m in synced] == [False, True]  # the file's bytes, then the directory's entry
    assert _core(tmp_path, resume=True).resumed  # and it reads back


# ---------------------------------------------------------------- the learner token


def test_the_learner_token_is_private_fresh_and_never_read_through_a_link(tmp_path):
    path = learner_token_path(tmp_path / "run")
    assert read_token(path) is None  # no file: no token (an open loopback buffer)
    first = read_token(create_token(path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(first) == 64
    assert read_token(create_token(path)) != first  # each run a fresh one
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path.unlink()
    path.symlink_to(victim)
    with pytest.raises(SecurityError, match="link"):
        read_token(path)
    create_token(path)  # replaces the link, never writes through it
    assert victim.read_text() == "precious" and not path.is_symlink()
    path.chmod(0o644)
    with pytest.raises(SecurityError, match="mode 0600"):
        read_token(path)
    path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"not a token")
    os.close(fd)
    with pytest.raises(SecurityError, match="holds no learner token"):
        read_token(path)


def test_the_learner_presents_the_token_only_in_the_handshake(tmp_path):
    """The token travels as ZMTP metadata of the connection: the buffer reads it off the frames, and no
    message the learner sends contains it."""
    token_file = create_token(learner_token_path(tmp_path))
    token = read_token(token_file)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    url = f"tcp://127.0.0.1:{port}"
    client = BufferClient(url, f"tcp://127.0.0.1:{port + 1}", "learner", role=LEARNER, token_file=token_file)
    try:
        client.send(P.Shutdown("done"))
        assert router.poll(5000)
        frames = router.recv_multipart(copy=False)
        assert token.encode() not in b"".join(f.bytes for f in frames)
        assert ConnectionRoles(False, token).of(frames[0]) == (LEARNER, "")
        assert ConnectionRoles(False, "0" * 64).of(frames[0]) == (PRODUCER, "")
        assert ConnectionRoles(False, None).of(frames[0]) == (LEARNER, "")  # no token file: open, as before
    finally:
        client.close()
        router.close(0)
        ctx.term()


# ---------------------------------------------------------------- keys


def test_keys_hold_one_role_each_and_a_bad_file_is_an_error_naming_it(tmp_path):
    keys = make_keys(tmp_path / "keys")
    roles = authorized_keys(keys)
    assert sorted(roles.values()) == [LEARNER, PRODUCER]
    assert all(stat.S_IMODE((keys / f"{n}.key_secret").stat().st_mode) == 0o600 for n in ("server", *roles.values()))
    assert load_pair(keys, LEARNER)[0] != load_pair(keys, PRODUCER)[0]
    ctx = zmq.Context()
    try:
        bad = keys / "authorized" / "producer" / "broken.key"
        bad.write_text("public-key = \"not z85 at all\"\n")
        with pytest.raises(SecurityError, match="broken.key"):
            ServerSecurity(ctx, str(keys))  # before any thread starts: nothing to clean up
        bad.unlink()
        (keys / "authorized" / "producer" / "dir.key").mkdir()
        with pytest.raises(SecurityError, match="dir.key"):
            authorized_keys(keys)
        (keys / "authorized" / "producer" / "dir.key").rmdir()
        (keys / "authorized" / "learner" / "also.key").write_bytes((keys / "producer.key").read_bytes())
        with pytest.raises(SecurityError, match="producer.key: this public key is admitted as learner too"):
            authorized_keys(keys)
        (keys / "authorized" / "learner" / "also.key").unlink()
        (keys / "authorized" / "learner" / "learner.key").unlink()
        with pytest.raises(SecurityError, match="admits no key"):
            authorized_keys(keys)
    finally:
        ctx.term()


def test_the_old_one_client_key_layout_is_refused_with_the_command_that_replaces_it(tmp_path):
    old = tmp_path / "old"
    (old / "authorized").mkdir(parents=True)
    zmq.auth.create_certificates(old, "server")
    zmq.auth.create_certificates(old, "client")
    (old / "authorized" / "client.key").write_bytes((old / "client.key").read_bytes())
    for call in (lambda: authorized_keys(old), lambda: load_pair(old, PRODUCER), lambda: make_keys(old)):
        with pytest.raises(SecurityError, match="old layout"):
            call()
    with pytest.raises(SecurityError, match="reinforce-ada keys --out"):
        load_pair(old, LEARNER)
    with pytest.raises(SecurityError, match=r"learner\.key_secret.*reinforce-ada keys"):
        load_pair(make_keys(tmp_path / "new") / "authorized", LEARNER)  # a directory without the learner's pair


@pytest.mark.slow
def test_the_buffer_refuses_to_start_on_an_unreadable_key_file_and_names_it(tmp_path):
    keys = make_keys(tmp_path / "keys")
    (keys / "authorized" / "producer" / "truncated.key").write_text("#   ZeroMQ CURVE Public Certificate\n")
    cmd = buffer_command(free_port_pair(), tmp_path, "--endpoints.keys_dir", str(keys))
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 2, run.stderr
    assert "truncated.key" in run.stderr and "reinforce-ada keys" in run.stderr and "Traceback" not in run.stderr
