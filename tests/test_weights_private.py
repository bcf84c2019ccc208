"""The file transport's weights folder is private and no link is followed to write or read weights: each test plays
another local user who reached the folder first (wrong mode, wrong owner, a link in place of the folder, a link at
the temporary name or at a version file) and shows the learner or the producer refuse, or write around it."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import stat

import pytest
import torch
from safetensors import safe_open

from pipeline.config import load_config
from pipeline.testing.doubles import FakeEngine
from pipeline.weights.file import FileLoader, FilePublisher, iter_file, publish_weights
from pipeline.weights.uris import weights_path

STATE = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16),
         "m": torch.tensor([True, False]), "e": torch.zeros(0)}
OTHER_UID = 54321


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_fresh_folder_is_0700_and_files_0600_and_they_round_trip(tmp_path):
    folder = tmp_path / "w"
    ann = publish_weights(STATE, folder, 1)
    assert mode(folder) == 0o700 and mode(ann.uri) == 0o600 and ann.num_bytes == os.path.getsize(ann.uri)
    got = dict(iter_file(ann.uri))
    assert got.keys() == STATE.keys() and all(torch.equal(got[k], STATE[k]) for k in STATE)
    with safe_open(ann.uri, framework="pt") as f:  # the safetensors library reads our file as its own
        assert f.metadata() == {"format": "pt", "version": "1"} and torch.equal(f.get_tensor("w"), STATE["w"])


def test_the_default_dev_shm_folder_is_private_and_a_precreated_one_is_refused(tmp_path):
    cfg = load_config(None, ["--run.dir", str(tmp_path), "--run.name", f"priv-{secrets.token_hex(3)}"])
    folder = cfg.weights_dir
    assert str(folder).startswith("/dev/shm/reinforce-ada-priv-")
    try:
        folder.mkdir(mode=0o777)  # another user's doing: created first, open to everyone
        folder.chmod(0o777)
        with pytest.raises(PermissionError, match=rf"weights folder {folder} has mode 0777.*chmod 700 {folder}"):
            FilePublisher(folder, keep=2).publish(STATE, 1)
        assert list(folder.iterdir()) == []
        folder.rmdir()
        ann = FilePublisher(folder, keep=2).publish(STATE, 1)
        assert mode(folder) == 0o700 and mode(ann.uri) == 0o600
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder of another user needs root (os.chown)")
def test_a_folder_of_another_user_is_refused_by_learner_and_producer(tmp_path):
    folder = tmp_path / "w"
    publish_weights(STATE, folder, 1)
    for target in (folder, weights_path(folder, 1)):
        os.chown(target, OTHER_UID, OTHER_UID)  # the other user's folder and file, with the right modes
    with pytest.raises(PermissionError, match=rf"weights folder {folder} is owned by uid {OTHER_UID}, not by this "
                                              r"user .*set weights\.dir to a folder of your own"):
        publish_weights(STATE, folder, 2)
    with pytest.raises(PermissionError, match=rf"owned by uid {OTHER_UID}"):
        iter_file(weights_path(folder, 1))
    os.chown(folder, os.geteuid(), os.getegid())  # our folder, but a file someone else put there
    with pytest.raises(PermissionError, match=r"not a regular file of this user"):
        iter_file(weights_path(folder, 1))


def test_a_link_in_place_of_the_folder_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "w"
    link.symlink_to(real)
    with pytest.raises(PermissionError, match=rf"weights folder {link} is a symbolic link \(to {real}\).*rm {link}"):
        publish_weights(STATE, link, 1)
    assert list(real.iterdir()) == []


def test_a_link_at_the_temporary_name_is_not_followed(tmp_path):
    folder, victim = tmp_path / "w", tmp_path / "victim.txt"
    victim.write_text("precious")
    folder.mkdir(mode=0o700)
    (folder / ".v000001.safetensors.tmp").symlink_to(victim)
    ann = publish_weights(STATE, folder, 1)
    assert victim.read_text() == "precious"
    assert not os.path.islink(ann.uri) and mode(ann.uri) == 0o600
    assert torch.equal(dict(iter_file(ann.uri))["w"], STATE["w"])
    assert sorted(p.name for p in folder.iterdir()) == ["v000001.safetensors"]


def test_a_link_at_a_version_file_is_refused_by_the_producer(tmp_path):
    folder = tmp_path / "w"
    publish_weights(STATE, folder, 1)
    forged = tmp_path / "forged.safetensors"  # another model's file, linked in as version 2
    shutil.copy(weights_path(folder, 1), forged)
    weights_path(folder, 2).symlink_to(forged)
    with pytest.raises(PermissionError, match=r"v000002\.safetensors is a symbolic link.*rm "):
        iter_file(weights_path(folder, 2))
    # the loader hands the engine the link's own path, never its target
    engine = FakeEngine()
    ann = publish_weights(STATE, folder, 3)
    weights_path(folder, 3).unlink()
    weights_path(folder, 3).symlink_to(forged)
    asyncio.run(FileLoader(engine, folder).load(ann))
    assert engine.loads == [(str(weights_path(folder, 3)), 3)]


def test_a_file_in_place_of_the_folder_is_refused(tmp_path):
    (tmp_path / "w").write_text("x")
    with pytest.raises(PermissionError, match=r"is not a folder"):
        publish_weights(STATE, tmp_path / "w", 1)


def test_train_refuses_a_precreated_open_folder_at_start(tmp_path, capsys):
    from pipeline.supervisor.main import main

    folder = tmp_path / "w"
    folder.mkdir()
    folder.chmod(0o777)
    assert main(["--run.dir", str(tmp_path / "runs"), "--run.name", "x", "--weights.dir", str(folder)]) == 2
    assert f"weights folder {folder} has mode 0777" in capsys.readouterr().err
    assert list(folder.iterdir()) == []
