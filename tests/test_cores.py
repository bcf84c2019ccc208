"""CPU core pinning of the learner and the engines (pipeline/cores.py, learner.cpu_cores, engine.cpu_cores)."""

import os

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.cores import compact, parse_cores, pin_cores


def test_core_lists_parse_and_print_back():
    assert parse_cores("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cores("5, 1") == [1, 5]
    assert compact([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    for bad, words in (("3-1", "backwards"), ("a", "not a core number"), ("1-", "not a core number")):
        with pytest.raises(ValueError, match=words):
            parse_cores(bad)


@pytest.mark.parametrize("key", ["learner.cpu_cores", "producers.engine.cpu_cores"])
def test_a_bad_core_list_fails_at_load_naming_the_setting(key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + ".*backwards"):
        load_config(None, [f"--{key}", "4-2"])
    cfg = load_config(None, [f"--{key}", "0"])  # a number, as the command line and TOML give one core
    assert str((cfg.learner if key.startswith("learner") else cfg.producers.engine).cpu_cores) == "0"


def test_pinning_sets_this_process_affinity_and_refuses_cores_it_lacks():
    before = os.sched_getaffinity(0)
    try:
        assert pin_cores("", "learner.cpu_cores") is None and os.sched_getaffinity(0) == before
        one = min(before)
        assert pin_cores(str(one), "learner.cpu_cores") == [one]
        assert os.sched_getaffinity(0) == {one}
        with pytest.raises(ValueError, match=r"learner\.cpu_cores = '4096' names core\(s\) \[4096\]"):
            pin_cores("4096", "learner.cpu_cores")
    finally:
        os.sched_setaffinity(0, before)
