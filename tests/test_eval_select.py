"""`reinforce-ada eval` and `reinforce-ada select-prompts` with real vLLM on the tiny model.

The runs that sample call the commands' `main` in this process, through the `reinforce-ada` dispatcher, with one
vLLM engine for the module (`pipeline.offline.make_llm` builds it at the first call and hands it out again to
calls with the same engine arguments): each engine start costs ~30 s of CPU, and the commands differ in their
data, reward and counts, not in the engine. The commands as processes (`python -m pipeline.cli ...`) run in the
tests of their errors."""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.data import make_arithmetic

pytestmark = pytest.mark.slow
REPO = Path(__file__).parents[1]
ENGINE = ["--producers.engine.max_model_len", "64", "--producers.engine.enforce_eager", "true",
          "--sampling.max_new_tokens", "8"]


def _cli(*args, timeout=400):
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def run_cli(tiny_model_dir):
    """run_cli(*args) -> (exit code, stdout): `reinforce-ada ARGS` in this process, sharing one engine."""
    from pipeline import offline
    from pipeline.cli import main

    real_make_llm, engines = offline.make_llm, {}

    def make_llm(cfg, model_dir):
        key = (os.path.realpath(model_dir), cfg.model.dtype, cfg.run.seed, repr(cfg.producers.engine))
        if key not in engines:  # another engine configuration: a new engine (none of these tests asks for one)
            for llm in engines.values():
                offline.shutdown_llm(llm)
            engines.clear()
            engines[key] = real_make_llm(cfg, model_dir)
        return engines[key]

    def run(*args):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(list(args))
        return code, out.getvalue()

    env = dict(os.environ)  # the engine's set-up writes the CPU backend's variables into this process's
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(offline, "make_llm", make_llm)
        yield run
    for llm in engines.values():
        offline.shutdown_llm(llm)
    os.environ.clear()
    os.environ.update(env)


def test_eval_of_a_run_directory_takes_its_latest_export_and_the_runs_config(tmp_path, run_cli, tiny_model_dir):
    """`eval --model RUN_DIR`: the run's latest checkpoint's export, read with the run's config (its eval_files).
    The export here is the tiny model itself (a link), so the module's engine serves it."""
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text("{}")
    (ckpt / "hf").symlink_to(tiny_model_dir.resolve(), target_is_directory=True)
    (run / "checkpoints" / "latest").write_text("step_000002")
    (run / "config.toml").write_text('[data]\neval_files = ["arithmetic"]\n')
    out = tmp_path / "eval.json"
    code, stdout = run_cli("eval", "--model", str(run), "--k", "2", "--limit", "20", "--out", str(out), *ENGINE)
    assert code == 0, stdout
    result = json.loads(out.read_text())
    assert result["model"] == str(ckpt / "hf") and result["benchmarks"]["arithmetic"]["problems"] == 20


def test_eval_reports_ave_at_k_per_benchmark_and_weighted(tmp_path, run_cli):
    data = tmp_path / "two_digit.jsonl"
    data.write_text("".join(json.dumps({"problem": ex.problem, "answer": ex.answer}) + "\n"
                            for ex in make_arithmetic(30, levels=(2,), seed=7)))
    out = tmp_path / "eval.json"
    code, stdout = run_cli("eval", "--model", "tiny", "--data", "arithmetic", str(data), "--k", "4", "--limit", "40",
                           "--out", str(out), *ENGINE)
    assert code == 0
    result = json.loads(out.read_text())
    bench = result["benchmarks"]
    assert set(bench) == {"arithmetic", "two_digit"}
    assert bench["arithmetic"]["problems"] == 40 and bench["two_digit"]["problems"] == 30
    for row in bench.values():
        assert 0.05 < row["ave_at_k"] < 0.8  # the tiny model solves about 0.3 of two-digit problems at T = 1
    weighted = (40 * bench["arithmetic"]["ave_at_k"] + 30 * bench["two_digit"]["ave_at_k"]) / 70
    assert abs(result["weighted_ave_at_k"] - weighted) < 1e-9
    assert "weighted average" in stdout


def test_select_prompts_keeps_the_pass_rate_window(tmp_path, run_cli):
    data = tmp_path / "train.jsonl"
    rows = [{"problem": ex.problem, "answer": ex.answer} for ex in make_arithmetic(40, levels=(1, 2), seed=3)]
    rows.append(dict(rows[0]))  # a duplicate is removed before sampling
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "selected.jsonl"
    code, stdout = run_cli("select-prompts", "--model", "tiny", "--data", str(data), "--out", str(out),
                           "--samples", "16", "--max-rate", "0.5", *ENGINE)
    assert code == 0
    # vLLM may log to stdout too: find the counts line
    counts = json.loads(next(line for line in stdout.splitlines() if line.startswith('{"problems"')))
    assert counts["problems"] == 40
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(kept) == counts["kept"] > 0
    assert all(1 / 16 <= r["pass_rate"] <= 0.5 for r in kept)


def test_eval_rejects_a_missing_file():
    proc = _cli("eval", "--model", "tiny", "--data", "/nonexistent.jsonl", timeout=60)
    assert proc.returncode == 2 and "no such file" in proc.stderr


def _verl_parquet(path: Path, examples) -> list[dict]:
    """The examples as rows of verl's format (a chat-message prompt, reward_model.ground_truth, extra_info)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "arithmetic", "prompt": [{"role": "user", "content": ex.problem}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": ex.answer},
             "extra_info": {"index": i, "aliases": [f"{ex.answer}."]}} for i, ex in enumerate(examples)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return rows


def test_eval_reads_verl_rows_like_plain_ones_and_scores_with_reward_fn(tmp_path, run_cli):
    """A chat-message prompt renders as the same problem does (one rendering path), and reward.fn with its extras
    scores the samples: the two files get the same Ave@k."""
    examples = make_arithmetic(30, levels=(2,), seed=7)
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"problem": ex.problem, "answer": ex.answer,
                                         "extra_info": {"aliases": [f"{ex.answer}."]}}) + "\n" for ex in examples))
    _verl_parquet(tmp_path / "verl.parquet", examples)
    out = tmp_path / "eval.json"
    code, _ = run_cli("eval", "--model", "tiny", "--data", str(plain), str(tmp_path / "verl.parquet"), "--k", "4",
                      "--out", str(out), *ENGINE, "--reward.fn", "pipeline.rewards.match:exact_match",
                      "--data.extra_keys", '["extra_info.aliases"]')
    assert code == 0
    bench = json.loads(out.read_text())["benchmarks"]
    assert bench["plain"]["problems"] == bench["verl"]["problems"] == 30
    assert 0.05 < bench["verl"]["ave_at_k"] < 0.8
    assert bench["verl"]["ave_at_k"] == bench["plain"]["ave_at_k"]


def test_select_prompts_writes_the_input_rows_back(tmp_path, run_cli):
    from pipeline.data import load_dataset

    rows = _verl_parquet(tmp_path / "verl.parquet", make_arithmetic(20, levels=(1, 2), seed=5))
    out = tmp_path / "selected.jsonl"
    args = ["select-prompts", "--model", "tiny", "--data", str(tmp_path / "verl.parquet"), "--out", str(out),
            "--samples", "4", "--min-rate", "0", "--max-rate", "1", *ENGINE,
            "--data.extra_keys", '["extra_info.aliases"]']
    proc = _cli(*args, timeout=60)  # math-verify takes no extras: an error before any engine starts
    assert proc.returncode == 2 and "reward.fn: pipeline.rewards.math:verify cannot be called" in proc.stderr
    code, _ = run_cli(*args, "--reward.fn", "pipeline.rewards.match:exact_match")
    assert code == 0
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k not in ("pass_rate", "source")} for r in kept] == rows
    assert [r["source"] for r in kept] == [f"verl.parquet:{i}" for i in range(1, 21)]
    assert all(r["pass_rate"] in (0, 0.25, 0.5, 0.75, 1) for r in kept)
    assert 0 < sum(r["pass_rate"] for r in kept) < 20
    again = load_dataset(out, extra_keys=["extra_info.aliases"])  # the same keys read the selection
    assert [ex.extras for ex in again] == [{"aliases": r["extra_info"]["aliases"]} for r in rows]
    assert again[0].messages == tuple(rows[0]["prompt"])


def test_vllm_serves_the_tiny_model_as_transformers_does(run_cli, tiny_model_dir):
    """The built tiny model in vLLM (the module's engine, as `eval` builds it): the tokenizer's prompt ids (BOS
    included), completions that decode to their text, log-probs of transformers' (float32, both temperatures), and
    answers that end with </s>."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    from pipeline import offline
    from pipeline import tiny_model as tm
    from pipeline.config import load_config

    llm = offline.make_llm(load_config(None, ENGINE), str(tiny_model_dir))  # the module's engine, shared
    prompts = [tm.PROMPT_TEMPLATE.format(problem=ex.problem) for ex in make_arithmetic(8, seed=99)]
    results = {t: llm.generate(prompts, SamplingParams(temperature=t, logprobs=0, n=4, seed=1, max_tokens=8),
                               use_tqdm=False) for t in (1.0, 0.7)}
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    worst, num_stopped = 0.0, 0
    for temperature, outputs in results.items():
        for prompt, out in zip(prompts, outputs):
            assert list(out.prompt_token_ids) == tok(prompt)["input_ids"]  # same BOS handling
            for comp in out.outputs:
                num_stopped += comp.finish_reason == "stop"
                assert comp.text == tok.decode(comp.token_ids, skip_special_tokens=True)
                ids = list(out.prompt_token_ids) + list(comp.token_ids)
                with torch.no_grad():
                    logits_TV = model(input_ids=torch.tensor([ids])).logits[0]
                ref_TV = torch.log_softmax(logits_TV / temperature, dim=-1)
                start = len(out.prompt_token_ids) - 1  # the logits at t predict the token at t + 1
                for i, token in enumerate(comp.token_ids):
                    got = comp.logprobs[i][token].logprob
                    worst = max(worst, abs(got - ref_TV[start + i, token].item()))
    assert worst <= 1e-3, worst
    assert num_stopped >= len(prompts) * 4  # at least half of the 2 x 8 x 4 completions end with </s>
