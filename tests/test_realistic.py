"""The pipeline on a model of realistic shape (pipeline/testing/realistic_model.py): a BPE tokenizer with an 8k
vocabulary, a chat template, tied embeddings, GQA, prompts of 50-500 tokens and hundreds of concurrent requests.
The tiny character model never splits a prompt across engine steps nor fills a batch with long prompts; these
tests exist because such bugs only show with real shapes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.testing.realistic_model import write_problems

pytestmark = pytest.mark.slow
REPO = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def problems(tmp_path_factory) -> Path:
    return write_problems(tmp_path_factory.mktemp("data") / "addition.jsonl", 400, seed=5)


def _cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_prompts_span_50_to_500_tokens(realistic_model_dir, problems):
    from transformers import AutoTokenizer

    from pipeline.data import load_dataset, render_prompt

    tok = AutoTokenizer.from_pretrained(realistic_model_dir)
    assert len(tok) >= 8192 and tok.chat_template
    lengths = sorted(len(tok(render_prompt(ex.problem, "auto", tok))["input_ids"]) for ex in load_dataset(problems))
    assert lengths[0] >= 50 and lengths[-1] <= 520 and lengths[len(lengths) // 2] > 150, lengths[::40]
    config = json.loads((realistic_model_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["num_key_value_heads"] < config["num_attention_heads"]


def test_eval_with_long_prompts_and_hundreds_of_concurrent_requests(realistic_model_dir, problems, tmp_path):
    # 200 prompts x k = 2: 400 seeded requests of 50-500 prompt tokens at once. With chunked prefill on the CPU
    # backend a partly prefilled seeded request killed the engine ("CPU Generator does not use offset").
    out = tmp_path / "eval.json"
    proc = _cli("eval", "--model", str(realistic_model_dir), "--data", str(problems), "--k", "2",
                "--limit", "200", "--max-new-tokens", "16", "--producers.engine.max_model_len", "1024",
                "--out", str(out))  # not eager: 400 prompts of 50-500 tokens earn back the compile
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["benchmarks"]["addition"]["problems"] == 200
    assert 0.05 < result["weighted_ave_at_k"] < 0.8  # the model is built to a pass rate of about 0.25


def test_engine_on_long_prompts_matches_the_learner_and_reloads_tied_weights(realistic_model_dir, problems,
                                                                             tmp_path):
    """64 rounds x 8 samples of 50-500-token prompts at once on one engine: every sample's log-probs equal the
    learner's for the same tokens (float32), before and after an in-place reload of weights whose tied
    embedding changed (published without `lm_head.weight`, as the learner publishes a tied model)."""
    import asyncio

    import numpy as np
    import torch
    from transformers import AutoTokenizer

    from pipeline import protocol as P
    from pipeline.config import EngineConfig, SamplingConfig
    from pipeline.consumer.model import load_model, token_logprobs
    from pipeline.data import load_dataset, render_prompt
    from pipeline.producer.engine import Engine
    from pipeline.weights.file import publish_weights

    tok = AutoTokenizer.from_pretrained(realistic_model_dir)
    examples = load_dataset(problems)[:64]
    prompts = [render_prompt(ex.problem, "auto", tok) for ex in examples]
    model = load_model(realistic_model_dir).eval()

    def check(outputs, model):
        for out in outputs:  # a round's 8 samples in one right-padded batch (causal: padding after is unseen)
            prompt = out.prompt_token_ids.tolist()
            seqs = [prompt + c.token_ids.tolist() for c in out.completions]
            ids = torch.full((len(seqs), max(map(len, seqs))), tok.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids, dtype=torch.bool)
            for i, seq in enumerate(seqs):
                ids[i, : len(seq)] = torch.tensor(seq)
                mask[i, len(prompt) - 1: len(seq) - 1] = True
            with torch.no_grad():
                ref, _ = token_logprobs(model, ids, None, 1.0, mask_BT=mask, with_entropy=False)
            for i, c in enumerate(out.completions):
                assert len(c.logprobs) == int(mask[i].sum())
                assert np.abs(ref[i][mask[i]].numpy() - c.logprobs).max() <= 1e-4

    async def scenario():
        # not eager: with ~100k prompt tokens per pass the compiled model earns back its ~10 s compile (eager:
        # 109 s vs 55 s for this test at load 4)
        engine = await Engine.start(realistic_model_dir, "float32", EngineConfig(max_model_len=1024),
                                    SamplingConfig(round_size=8, max_new_tokens=24), seed=0)
        try:
            rounds = [P.RoundAssignment(i, i, p, ex.answer, 8, 60.0) for i, (p, ex) in enumerate(zip(prompts,
                                                                                                    examples))]
            before = await asyncio.gather(*(engine.generate_round(a) for a in rounds))
            with torch.no_grad():  # new weights: the tied embedding (and so the output layer) moves
                model.model.embed_tokens.weight.mul_(1.5)
            state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
            ann = publish_weights(state, tmp_path / "weights", 1)
            await engine.load_weights(ann.uri, 1)
            after = await asyncio.gather(*(engine.generate_round(
                P.RoundAssignment(1000 + a.round_id, a.prompt_id, a.prompt, a.answer, 8, 60.0)) for a in rounds))
            return before, after
        finally:
            await engine.shutdown()

    reference = load_model(realistic_model_dir).eval()
    before, after = asyncio.run(scenario())
    assert all(len(o.completions) == 8 for o in before + after)
    assert min(len(o.prompt_token_ids) for o in before) >= 50
    check(before, reference)
    check(after, model)
    assert all(c.version == 1 for o in after for c in o.completions)


def _verl_parquet(path: Path, problems: Path, with_aliases: bool) -> Path:
    """The problems in the official Reinforce-Ada / verl format: `prompt` as chat messages, the gold answer under
    `reward_model.ground_truth`. The ground truth here is never the answer: only `extra_info.aliases` (reward
    extras) holds it, so the reward fires only if the extras reach the producers' reward function."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.data import INSTRUCTION

    rows = [json.loads(line) for line in problems.read_text().splitlines()]
    table = pa.Table.from_pylist([
        {"data_source": "addition", "prompt": [{"role": "user", "content": f"{r['problem']}\n{INSTRUCTION}"}],
         "reward_model": {"style": "rule", "ground_truth": "no such answer"},
         "extra_info": {"index": i, "aliases": [r["answer"]] if with_aliases else []}} for i, r in enumerate(rows)])
    pq.write_table(table, path)
    return path


def _train(tmp_path, model_dir, data: Path, name: str, *extra: str):
    # one eager producer: what is checked (steps, rewards, the extras reaching the reward, the stop) needs no
    # second engine, and each engine start costs ~26 s of CPU (+ ~10 s of compilation without enforce_eager)
    return _cli("train", "--config", str(REPO / "configs" / "tiny.toml"), "--model.path", str(model_dir),
                "--data.train_files", json.dumps([str(data)]), "--data.extra_keys", '["extra_info.aliases"]',
                "--reward.fn", "pipeline.rewards.match:exact_match", "--sampling.max_new_tokens", "24",
                "--producers.engine.max_model_len", "1024", "--producers.engine.enforce_eager", "true",
                "--producers.count", "1", "--learner.batch_prompts", "8",
                "--learner.mini_batches", "1", "--learner.eval_every", "0", "--learner.checkpoint_every", "0",
                "--run.dir", str(tmp_path), "--run.name", name, "--endpoints.router_port", "0", *extra, timeout=900)


def test_train_takes_steps_and_a_reward_that_never_fires_stops_the_run(realistic_model_dir, problems, tmp_path):
    """The issue's scenario on a model of realistic shape, with a verl-format parquet and a custom reward whose
    extras travel with every round: the learner takes its steps; without the extras the reward never fires, and
    the run ends with that cause instead of waiting in silence."""
    good = _train(tmp_path, realistic_model_dir, _verl_parquet(tmp_path / "good.parquet", problems, True), "good",
                  "--learner.num_steps", "2")
    run = tmp_path / "good"
    logs = "".join(p.read_text(errors="replace")[-3000:] for p in sorted((run / "logs").glob("*.log")))
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-3000:] + logs
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["num_groups"] == 8 for r in rows)
    assert all(0 < r["reward_mean"] < 1 and r["prompt_len_mean"] > 50 for r in rows)

    bad = _train(tmp_path, realistic_model_dir, _verl_parquet(tmp_path / "bad.parquet", problems, False), "bad",
                 "--learner.num_steps", "50", "--buffer.stop_without_signal", "256")
    assert bad.returncode != 0
    assert "buffer stopped the run" in bad.stderr and "reward never fired" in bad.stderr, bad.stderr[-3000:]
    buffer_log = (tmp_path / "bad" / "logs" / "buffer.log").read_text()
    assert "stopping the run: the reward never fired" in buffer_log and "check the answer format" in buffer_log


def test_prompts_longer_than_the_context_stop_the_run_at_start(tmp_path):
    """MATH500 on the tiny model (max_model_len 64): the run stops before any engine starts, saying why."""
    math500 = REPO.parent / "shared" / "data" / "benchmarks" / "math500.jsonl"
    proc = _cli("train", "--config", str(REPO / "configs" / "tiny.toml"), "--data.train_files",
                json.dumps([str(math500)]), "--run.dir", str(tmp_path), "--endpoints.router_port", "0", timeout=300)
    assert proc.returncode != 0
    assert "do not fit" in proc.stderr and "max_model_len (64)" in proc.stderr, proc.stderr[-2000:]
    assert not list((tmp_path / "tiny" / "logs").glob("producer-*.log"))  # no engine was started


def test_a_build_outside_its_pass_rate_band_raises_and_saves_nothing(tmp_path):
    """The build's band is enforced, not only its floor: a model that is never right (or always) would make every
    RL test on it vacuous. One step is far below any floor."""
    from pipeline.testing.realistic_model import build

    with pytest.raises(RuntimeError, match=r"pass rate 0\.\d\d at T=1.0 after 1 steps is outside \(0.5, 0.6\)"):
        build(tmp_path / "m", steps=1, check_every=1, target=(0.5, 0.6), log=lambda _: None)
    assert not (tmp_path / "m" / "model.safetensors").exists()
