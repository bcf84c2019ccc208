"""README claims that had no test of their own: chunked prefill refused on the CPU backend, overlong prompts left
out with a warning, `learner.gradient_checkpointing` recomputing activations without changing the update, and
`weights.keep` deleting only weight files no producer can still need."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from pipeline.config import EngineConfig, load_config

# ---------------------------------------------------------------- chunked prefill on the CPU


def test_chunked_prefill_is_off_on_the_cpu_and_refused_when_asked_for():
    from pipeline.producer.engine import engine_kwargs

    cpu = engine_kwargs("no-such-model", "float32", EngineConfig(), seed=0, cpu=True)
    assert cpu["enable_chunked_prefill"] is False
    assert cpu["max_num_batched_tokens"] >= cpu["max_model_len"]  # a step's batch holds any whole prompt
    asked = EngineConfig(extra={"enable_chunked_prefill": True})
    with pytest.raises(ValueError, match=r"producers\.engine\.extra: enable_chunked_prefill = true"):
        engine_kwargs("no-such-model", "float32", asked, seed=0, cpu=True)
    # on GPUs it is vLLM's choice, and a config may turn it on
    assert "enable_chunked_prefill" not in engine_kwargs("no-such-model", "float32", EngineConfig(), seed=0)
    assert engine_kwargs("no-such-model", "float32", asked, seed=0)["enable_chunked_prefill"] is True


# ---------------------------------------------------------------- overlong prompts


def _problems(path: Path, num_short: int, num_long: int) -> Path:
    rows = [{"problem": f"{10 + i}+{20 + i}", "answer": str(30 + 2 * i)} for i in range(num_short)]
    rows += [{"problem": "+".join(["1"] * 150 + [str(i)]), "answer": str(150 + i)} for i in range(num_long)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_overlong_prompts_are_left_out_with_a_warning(tmp_path, tiny_model_dir, caplog):
    from pipeline.prompts import PromptsError, build_prompts

    data = _problems(tmp_path / "train.jsonl", num_short=8, num_long=2)
    args = ["--model.path", str(tiny_model_dir), "--data.train_files", json.dumps([str(data)]),
            "--learner.eval_every", "0", "--sampling.max_new_tokens", "16", "--data.shuffle", "false"]
    with caplog.at_level(logging.WARNING, logger="pipeline.prompts"):
        run = build_prompts(load_config(None, args), str(tiny_model_dir))
    assert len(run.train) == 8 and run.num_overlong == 2
    assert all("1+1+1" not in p.text for p in run.train)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("2 of 10 training prompts do not fit" in m and "left out" in m for m in warned), warned
    # more than data.max_overlong_share of the data: an error naming the setting, not a silent sliver
    with pytest.raises(PromptsError, match=r"data\.max_overlong_share"):
        build_prompts(load_config(None, args + ["--data.max_overlong_share", "0.1"]), str(tiny_model_dir))


# ---------------------------------------------------------------- learner.gradient_checkpointing


def _train_once(model_dir: Path, run_dir: Path, groups, checkpointing: bool) -> tuple[dict, int, int]:
    """One learner step; returns (weights after it, calls of the first decoder layer, modules that checkpoint)."""
    from pipeline.consumer.learner import Learner
    from pipeline.testing.learner import make_cfg

    cfg = make_cfg(model_dir, run_dir, "torch", 0, "--learner.gradient_checkpointing", json.dumps(checkpointing))
    learner = Learner(cfg)
    model = learner.policy.model if hasattr(learner.policy, "model") else learner.policy
    layers = [m for name, m in model.named_modules() if name.endswith("layers.0")]
    assert len(layers) == 1, [name for name, _ in model.named_modules()]
    calls = [0]
    # a pre-hook: the recomputation in backward stops once it has what it needs, before any forward hook
    layers[0].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    learner.train_step(groups)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return weights, calls[0], sum(1 for m in model.modules() if getattr(m, "gradient_checkpointing", False))


def test_gradient_checkpointing_recomputes_activations_and_changes_nothing_else(tmp_path):
    from pipeline.testing.learner import make_groups, make_tiny_model

    model_dir = make_tiny_model(tmp_path / "model")
    groups = make_groups(model_dir, num_groups=4, seed=1)
    plain, plain_calls, plain_flags = _train_once(model_dir, tmp_path / "plain", groups, False)
    ckpt, ckpt_calls, ckpt_flags = _train_once(model_dir, tmp_path / "ckpt", groups, True)
    assert plain_flags == 0 and ckpt_flags > 0  # the setting reached the model
    # each micro-batch runs the layer once forward and once more in backward to rebuild its activations
    assert plain_calls > 0 and ckpt_calls == 2 * plain_calls, (plain_calls, ckpt_calls)
    assert plain.keys() == ckpt.keys()
    for name in plain:  # the same update: recomputation changes memory and time, not the gradients
        torch.testing.assert_close(ckpt[name], plain[name], rtol=0, atol=1e-6, msg=name)


# ---------------------------------------------------------------- weights.keep


def test_weights_keep_deletes_only_files_no_producer_can_still_need(tmp_path):
    from pipeline.weights.file import FilePublisher, iter_file, published_versions, weights_path

    folder = tmp_path / "w"
    pub = FilePublisher(folder, keep=1)
    states = {v: {"a": torch.full((4,), float(v)), "b": torch.full((2, 3), -float(v))} for v in (1, 2, 3)}
    ann = pub.publish(states[1], 1)
    reading = iter_file(ann.uri)  # a producer opened version 1 and reads it tensor by tensor, slowly
    first = next(reading)
    for v in (2, 3):
        ann = pub.publish(states[v], v)
        # the announced version, the only one a producer is sent to load, is always there
        assert Path(ann.uri).is_file() and published_versions(folder) == [v]
    assert not weights_path(folder, 1).exists()  # deleted, with a reader still inside it ...
    got = dict([first, *reading])  # ... who reads every tensor of its version to the end
    assert got.keys() == states[1].keys() and all(torch.equal(got[k], states[1][k]) for k in got)
    assert all(torch.equal(t, states[3][k]) for k, t in iter_file(ann.uri))
