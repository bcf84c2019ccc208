"""A CurveZMQ secret key that group or others may read is refused when loaded, naming the file and `chmod 600`:
whoever can read it can act as its role (the learner's key takes batches and stops the run)."""

from __future__ import annotations

import pytest

from pipeline.auth import LEARNER, PRODUCER, SERVER_KEY, SecurityError, load_pair, make_keys


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
