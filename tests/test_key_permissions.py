"""A CurveZMQ secret key that group or others may read is refused when loaded, naming the file and `chmod 600`:
whoever can read it can act as its role (the learner's key takes batches and stops the run)."""

from __future__ import annotations

import re

import pytest

from pipeline.auth import LEARNER, PRODUCER, SERVER_KEY, SecurityError, add_producer_keys, load_pair, make_keys


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
@pytest.mark.parametrize("name", [SERVER_KEY, PRODUCER, LEARNER])
def test_a_readable_secret_key_is_refused_naming_it_and_the_fix(tmp_path, name, mode):
    keys = make_keys(tmp_path / "keys")
    secret = keys / f"{name}.key_secret"
    secret.chmod(mode)
    with pytest.raises(SecurityError, match=rf"secret key {secret} has mode {mode:04o}.*chmod 600 {secret}"):
        load_pair(keys, name)
    secret.chmod(0o600)
    assert len(load_pair(keys, name)[1]) == 40  # z85 of 32 bytes


def test_keys_command_makes_a_key_per_named_producer_and_adds_one_without_touching_the_rest(tmp_path, capsys):
    from pipeline.auth import authorized_keys, client_key_name
    from pipeline.cli import main

    out = tmp_path / "keys"
    assert main(["keys", "--out", str(out), "--producer", "b0", "--producer", "b1"]) == 0
    assert "NAME.key* for producer NAME (b0, b1" in capsys.readouterr().out
    admitted = authorized_keys(out)
    assert sorted(admitted.values()) == [LEARNER, PRODUCER, PRODUCER]
    assert not (out / "producer.key").exists()  # no shared producer pair: each producer is one client
    assert client_key_name(out, PRODUCER, "b1") == "b1"
    server = (out / "server.key_secret").read_bytes()
    # again on the same directory: refused (fresh keys would lock out every machine holding a copy)
    assert main(["keys", "--out", str(out)]) == 2
    assert "holds keys already" in capsys.readouterr().err
    # a new producer machine: its pair is added, the server's and everyone's keys stay
    assert main(["keys", "--out", str(out), "--producer", "c0"]) == 0
    assert "restart the buffer" in capsys.readouterr().out
    assert (out / "server.key_secret").read_bytes() == server and len(authorized_keys(out)) == 4
    assert oct((out / "c0.key_secret").stat().st_mode & 0o777) == oct(0o600)
    assert len(load_pair(out, "c0")[1]) == 40
    for again, why in ((["b0"], "holds keys for \\['b0'\\] already"), (["d", "d"], "repeat a name"),
                       (["learner"], "cannot name key files"), (["../x"], "cannot name key files")):
        assert main(["keys", "--out", str(out), *(a for n in again for a in ("--producer", n))]) == 2
        assert re.search(why, capsys.readouterr().err), why
    with pytest.raises(SecurityError, match="holds no server key"):
        add_producer_keys(tmp_path / "empty", ["e0"])
