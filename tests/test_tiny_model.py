"""The tiny arithmetic model: tokenizer, config, determinism, pass-rate window, cache handling. (Its vLLM parity
with transformers is tested in test_eval_select.py, on that module's engine.)"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pipeline import tiny_model as tm
from pipeline.data import make_arithmetic

PRINTABLE = "".join(tm.CHARS)


@pytest.fixture(scope="module")
def tokenizer():
    return tm.make_tokenizer()


def test_tokenizer_one_token_per_character_with_bos(tokenizer):
    ids = tokenizer("12+34=")["input_ids"]
    assert ids[0] == tm.BOS_ID and len(ids) == 1 + len("12+34=")
    assert tokenizer.convert_ids_to_tokens(ids[1:]) == list("12+34=")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12+34="
    assert tokenizer.decode([*tokenizer.encode("46", add_special_tokens=False), tm.EOS_ID],
                            skip_special_tokens=True) == "46"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id) == (
        tm.BOS_ID, tm.EOS_ID, tm.PAD_ID, tm.UNK_ID)
    assert tokenizer.encode("é", add_special_tokens=False) == [tm.UNK_ID]


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=PRINTABLE, max_size=40))
def test_tokenizer_round_trip(tokenizer, text):
    assume(not any(special in text for special in tm.SPECIAL_TOKENS))  # these parse as one special token
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # no merges, no added spaces, no stripping
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text


@pytest.fixture(scope="module")
def short_build(tmp_path_factory) -> Path:
    """A tiny model built with a few steps only: the files and shapes of a full build, in a second."""
    out = tmp_path_factory.mktemp("tiny") / "model"
    tm.build_tiny_model(out, seed=0, max_steps=3, target_pass_rate=None, pass_window=None, num_eval=8,
                        log=lambda *_: None)
    return out


def test_saved_directory_has_what_vllm_and_transformers_need(short_build):
    from transformers import AutoConfig, AutoTokenizer

    tiny_model_dir = short_build
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json", tm.STATS_FILE} <= names
    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert config.head_dim >= 32  # vLLM's CPU attention rejects head_dim 16
    assert config.head_dim * config.num_attention_heads == config.hidden_size
    assert config.max_position_embeddings >= 64 and config.tie_word_embeddings is False
    assert str(config.dtype).endswith("float32")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert config.vocab_size == len(tok) and tok.chat_template is None
    assert tok("7-9=")["input_ids"] == [tm.BOS_ID] + tok.encode("7-9=", add_special_tokens=False)
    # sampling defaults in generation_config.json would silently change vLLM's default SamplingParams
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert not {"temperature", "top_p", "top_k", "do_sample"} & set(gen)
    assert gen["eos_token_id"] == tm.EOS_ID
    stats = tm.read_stats(tiny_model_dir)
    assert stats["builder_version"] == tm.BUILDER_VERSION and stats["seed"] == 0


def test_short_builds_are_deterministic_per_seed(tmp_path):
    from safetensors.torch import load_file

    kwargs = dict(max_steps=3, target_pass_rate=None, pass_window=None, num_eval=8, log=lambda *_: None)
    stats = [tm.build_tiny_model(tmp_path / name, seed=seed, **kwargs)
             for name, seed in (("a", 7), ("b", 7), ("c", 8))]
    a, b, c = (load_file(tmp_path / name / "model.safetensors") for name in "abc")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert any(not (a[k] == c[k]).all() for k in a)
    assert stats[0]["final_loss"] == stats[1]["final_loss"] and stats[0]["steps"] == 3


def test_build_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="max_steps"):
        tm.build_tiny_model(tmp_path, max_steps=0)
    with pytest.raises(ValueError, match="level_weights"):
        tm.build_tiny_model(tmp_path, level_weights=(1.0, 2.0))  # one weight per level: (2,) has one


def _pass_rate_with_generate(model_dir: Path, num: int, seed: int) -> float:
    """An independent re-measure: transformers' own sampler, full vocabulary, T=1.0, left-padded batch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    examples = make_arithmetic(num, levels=tm.TASK_LEVELS, seed=seed)
    batch = tok([tm.PROMPT_TEMPLATE.format(problem=ex.problem) for ex in examples], padding=True,
                padding_side="left", return_tensors="pt")
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8,
                             pad_token_id=tm.PAD_ID, eos_token_id=tm.EOS_ID)
    correct = 0
    for ex, row in zip(examples, out[:, batch["input_ids"].shape[1]:].tolist()):
        if tm.EOS_ID in row:
            correct += tok.decode(row[: row.index(tm.EOS_ID)]) == ex.answer
    return correct / num


@pytest.mark.slow
def test_pass_rate_at_temperature_one_leaves_room_for_rl(tiny_model_dir):
    stats = tm.read_stats(tiny_model_dir)
    assert 0.2 <= stats["pass_rate"] <= 0.6, stats
    assert 0.2 <= _pass_rate_with_generate(tiny_model_dir, num=200, seed=12345) <= 0.6


@pytest.mark.slow
def test_ensure_reuses_a_current_build(tiny_model_dir, capsys):
    before = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    assert tm.ensure_tiny_model(tiny_model_dir, seed=0) == tiny_model_dir
    assert tm.main(["--out", str(tiny_model_dir)]) == 0
    assert json.loads(capsys.readouterr().out)["model_dir"] == str(tiny_model_dir)
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_the_shipped_seed_0_build_is_current_and_copied_instead_of_built(tmp_path, monkeypatch):
    assert tm.is_current(tm.SHIPPED, 0), ("pipeline/assets/tiny-model is not of this builder's version: refresh it "
                                          "with `reinforce-ada make-tiny-model --out pipeline/assets/tiny-model "
                                          "--force` and commit it")
    monkeypatch.setattr(tm, "build_tiny_model", lambda *a, **k: pytest.fail("seed 0 was built, not copied"))
    out = tm.ensure_tiny_model(tmp_path / "m", seed=0, log=lambda *_: None)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in tm.SHIPPED.iterdir())
    assert (out / "model.safetensors").read_bytes() == (tm.SHIPPED / "model.safetensors").read_bytes()
    calls = []
    monkeypatch.setattr(tm, "build_tiny_model", lambda out_dir, seed=0, log=print: calls.append(seed) or
                        (Path(out_dir) / tm.STATS_FILE).write_text(json.dumps({"builder_version": tm.BUILDER_VERSION,
                                                                               "seed": seed})))
    tm.ensure_tiny_model(tmp_path / "m", seed=0, force=True)  # --force builds from scratch
    tm.ensure_tiny_model(tmp_path / "s1", seed=1)  # other seeds are built
    assert calls == [0, 1]


def test_ensure_rebuilds_stale_once_under_concurrency_and_guards_foreign_dirs(tmp_path, monkeypatch):
    calls = []

    def fake_build(out_dir, seed=0, log=print):
        calls.append(seed)
        (Path(out_dir) / tm.STATS_FILE).write_text(json.dumps({"builder_version": tm.BUILDER_VERSION,
                                                               "seed": seed}))

    monkeypatch.setattr(tm, "build_tiny_model", fake_build)
    out = tmp_path / "model"
    out.mkdir()
    (out / tm.STATS_FILE).write_text(json.dumps({"builder_version": -1, "seed": 3}))
    (out / "old-weights").write_text("stale")
    threads = [threading.Thread(target=tm.ensure_tiny_model, args=(out, 3)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [3]  # the lock made the other callers find the finished build
    assert tm.read_stats(out)["builder_version"] == tm.BUILDER_VERSION
    assert not (out / "old-weights").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.lock", "model"]  # no temp dirs left
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a tiny-model directory"):
        tm.ensure_tiny_model(foreign)
    assert (foreign / "precious.txt").exists()


def test_cli_help_is_cheap():
    with pytest.raises(SystemExit) as exc:
        tm.main(["--help"])
    assert exc.value.code == 0
