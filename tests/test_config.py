"""Configuration: every shipped file loads, overrides apply, and bad values name the field and the fix."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pipeline.config import (
    Config,
    ConfigError,
    EndpointsConfig,
    EngineConfig,
    LearnerConfig,
    SamplingConfig,
    dumps_toml,
    from_dict,
    key_path,
    load_config,
    reference_markdown,
)
from pipeline.config.base import fields, is_section, unwrap

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.toml"))


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"tiny.toml", "qwen2.5-math-1.5b.toml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    # the resolved config round-trips through its TOML text
    assert from_dict(tomllib.loads(dumps_toml(cfg))) == cfg


def test_paper_config_matches_the_paper():
    cfg = load_config(Path(__file__).parents[1] / "configs" / "qwen2.5-math-1.5b.toml")
    s, lr = cfg.sampling, cfg.learner
    assert (lr.batch_prompts, s.group_size, s.round_size, s.max_rounds) == (512, 4, 8, 4)
    assert (lr.lr, s.temperature, s.max_new_tokens) == (1e-6, 1.0, 2048)
    assert (lr.clip_low, lr.clip_high, lr.dual_clip) == (0.2, 0.28, 10.0)
    assert lr.num_ranks + cfg.producers.count == 8


def test_defaults_are_valid():
    cfg = load_config(None)
    assert cfg.sampling.exit_rule == "balance" and cfg.buffer.max_staleness == 1


def test_overrides_both_forms():
    cfg = load_config(None, ["--sampling.round_size", "6", "--learner.lr=3e-5", "--data.train_files", '["a.jsonl"]',
                             "--sampling.exit_rule", "pos", "--producers.engine.enforce_eager", "true"])
    assert cfg.sampling.round_size == 6
    assert cfg.learner.lr == 3e-5
    assert cfg.data.train_files == ["a.jsonl"]
    assert cfg.sampling.exit_rule == "pos"
    assert cfg.producers.engine.enforce_eager is True


@pytest.mark.parametrize(
    "overrides, expect",
    [
        (["--sampling.roud_size", "3"], "did you mean `sampling.round_size`"),
        (["--samplng.round_size", "3"], "did you mean `sampling`"),
        (["--producers.engine.max_num_sqs", "3"], "did you mean `producers.engine.max_num_seqs`"),
        (["--sampling.round_size", "0"], "sampling.round_size: must be >= 1"),
        (["--sampling.exit_rule", "bal"], "sampling.exit_rule"),
        (["--learner.lr", "fast"], "learner.lr"),
        (["--learner.mini_batches", "3"], "learner.mini_batches: must divide"),
        (["--buffer.max_staleness", "-1"], "buffer.max_staleness"),
        (["--endpoints.router_port", "70000"], "endpoints.router_port"),
        (["--sampling.temperature", "0"], "sampling.temperature"),
        (["--sampling"], "missing value"),
        (["sampling.round_size"], "expected --section.key VALUE"),
        (["--learner.lr", "-1"], "learner.lr: must be > 0, got -1 (AdamW learning rate"),
        (["--learner.lr", "fast"], 'learner.lr: expected float, got "fast"'),
        (["--sampling.exit_rule", "bal"], 'sampling.exit_rule: \'bal\' is not allowed (did you mean "balance"?)'),
        (["--data.arithmetic_levels", "[4]"], "data.arithmetic_levels: 4 is not allowed; choose one of 1, 2, 3"),
        (["--data.train_files", "[]"], "data.train_files: must not be empty"),
        (["--sampling.top_p", "1.5"], "sampling.top_p: must be in (0, 1], got 1.5"),
        (["--producers.count", "1", "--producers.devices", '["0", "1"]'],
         "producers.devices: give one entry per producer (`producers.count` = 1) or none"),
        (["--producers.engine", "3"], "producers.engine: must be a table"),
        (["--learner.num_nodes", "2", "--learner.num_ranks", "2"],
         'learner.num_nodes: 2 nodes need run.launcher = "ray"'),
        (["--learner.num_nodes", "2", "--learner.num_ranks", "3", "--run.launcher", "ray"],
         "learner.num_nodes: must divide `learner.num_ranks` (3)"),
        (["--endpoints.control_port", "5556"], "endpoints.control_port: no longer a setting; it is always "
                                               "endpoints.router_port + 1"),
    ],
)
def test_bad_values_name_the_field(overrides, expect):
    with pytest.raises(ConfigError, match=re.escape(expect)):
        load_config(None, overrides)


def test_enum_error_lists_choices():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--sampling.exit_rule", "bal"])
    assert "balance" in str(err.value) and "fixed" in str(err.value)


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[sampling\nround_size = 3")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


def test_check_config_cli(tmp_path):
    cmd = [sys.executable, "-m", "pipeline.cli", "check-config"]
    ok = subprocess.run(cmd + ["configs/tiny.toml", "--sampling.round_size", "6"], capture_output=True, text=True,
                        cwd=Path(__file__).parents[1])
    assert ok.returncode == 0, ok.stderr
    assert "round_size = 6" in ok.stdout
    bad = subprocess.run(cmd + ["configs/tiny.toml", "--sampling.roud_size", "6"], capture_output=True, text=True,
                         cwd=Path(__file__).parents[1])
    assert bad.returncode == 2
    assert "did you mean `sampling.round_size`" in bad.stderr


def test_train_refuses_a_missing_data_file_before_starting_anything(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "train", "--data.train_files", '["missing.jsonl"]',
                           "--run.dir", str(tmp_path)], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert proc.returncode == 2
    assert "data.train_files: missing.jsonl does not exist" in proc.stderr
    assert not any(tmp_path.iterdir())  # no run directory, no process started


def _sections(cls=Config, prefix=""):
    yield cls, prefix
    for name, info in fields(cls).items():
        if is_section(info.type):
            yield from _sections(unwrap(info.type)[0], f"{prefix}.{name}" if prefix else name)


def test_every_field_is_documented_once_in_its_type():
    for cls, _ in _sections():
        for name, info in fields(cls).items():
            if not is_section(info.type):
                meta = unwrap(info.type)[1]
                assert meta is not None and meta.description, f"{cls.__name__}.{name} needs Meta(description=...)"
    text = reference_markdown()
    assert "| `sampling.round_size` | `8` | int >= 1 | M: samples per round of one prompt |" in text
    assert '| `learner.backend` | `"torch"` | one of "torch", "deepspeed" |' in text
    assert "**[producers.engine]**" in text and "`producers.engine.max_model_len`" in text


def test_error_paths_come_from_where_the_field_lives():
    assert key_path(EngineConfig, "max_model_len") == "producers.engine.max_model_len"
    assert key_path(LearnerConfig, "lr") == "learner.lr"
    with pytest.raises(AssertionError):
        key_path(LearnerConfig, "no_such_field")
    # bounds checked by msgspec at decode and by the section when built in code give the same message
    for make in (lambda: load_config(None, ["--producers.engine.max_model_len", "8"]),
                 lambda: EngineConfig(max_model_len=8)):
        with pytest.raises(ConfigError, match=r"^producers\.engine\.max_model_len: must be >= 16, got 8 \(prompt"):
            make()
    # a cross-field check names its key, and the sibling it mentions, with the section's path
    with pytest.raises(ConfigError, match=r"^sampling\.round_size: `sampling\.round_size` \* `sampling\.max_rounds` "
                                          r"must be >= `sampling\.group_size` \(40\)"):
        SamplingConfig(group_size=40)


def test_control_port_is_derived_from_the_router_port():
    assert load_config(None, ["--endpoints.router_port", "6000"]).endpoints.control_port == 6001
    assert EndpointsConfig(router_port=0).control_port == 0  # both chosen at bind (`train` picks a free pair)
    assert "control_port" not in dumps_toml(Config())


def test_check_config_markdown_and_readme(tmp_path):
    cmd = [sys.executable, "-m", "pipeline.cli", "check-config"]
    out = subprocess.run(cmd + ["--markdown"], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert out.returncode == 0 and out.stdout == reference_markdown()
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n## Configuration reference\n\nSTALE-TABLE\n\n## Results\n\nkept\n")
    done = subprocess.run(cmd + ["--readme", str(readme)], capture_output=True, text=True,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr
    text = readme.read_text()
    assert text.startswith("# x\n\n" + reference_markdown() + "## Results\n\nkept\n") and "STALE-TABLE" not in text
