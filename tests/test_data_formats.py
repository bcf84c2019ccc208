"""The reference data format (verl's Parquet: chat-message `prompt`, `reward_model.ground_truth`), dotted keys,
extras for the reward, the system prompt, Hugging Face datasets, and one rendering path for every command."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import ConfigError, load_config
from pipeline.data import DatasetError, Example, check_source, load_dataset, render_prompt, source_name
from pipeline.prompts import PromptsError, benchmark_name, build_prompts, load_examples, render_examples

INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def verl_rows() -> list[dict]:
    """Rows as the official Reinforce-Ada / verl preprocessing writes them."""
    rows = []
    for i, (question, answer) in enumerate([("What is 2+3?", "5"), ("Solve x+1=3.", "2"), ("Half of 9?", "4.5")]):
        prompt = [{"role": "user", "content": f"{question} {INSTRUCTION}"}]
        if i == 1:
            prompt.insert(0, {"role": "system", "content": "You are a careful solver."})
        rows.append({
            "data_source": "math_dapo",
            "prompt": prompt,
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "train", "index": i, "question": question, "tests": [f"assert f({i}) == {i}"]},
        })
    return rows


@pytest.fixture
def verl_parquet(tmp_path) -> Path:
    path = tmp_path / "dapo_train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows()), path)
    return path


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


class FakeChatTokenizer:
    """A test double with just what render_prompt uses."""

    chat_template = "set"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


# ---- loading the verl format ----


def test_verl_parquet_loads_with_no_keys_set(verl_parquet):
    got = load_dataset(verl_parquet)
    assert [ex.answer for ex in got] == ["5", "2", "4.5"]
    assert [ex.problem for ex in got] == [f"{q} {INSTRUCTION}" for q in ("What is 2+3?", "Solve x+1=3.", "Half of 9?")]
    assert got[0].messages == ({"role": "user", "content": f"What is 2+3? {INSTRUCTION}"},)
    assert [m["role"] for m in got[1].messages] == ["system", "user"]
    assert [ex.source for ex in got] == ["dapo_train.parquet:1", "dapo_train.parquet:2", "dapo_train.parquet:3"]
    assert all(ex.extras == {} for ex in got)
    # the keys the issue names, given explicitly, read the same
    assert load_dataset(verl_parquet, problem_key="prompt", answer_key="reward_model.ground_truth") == got


def test_dotted_problem_key_reads_a_nested_string(verl_parquet):
    got = load_dataset(verl_parquet, problem_key="extra_info.question", answer_key="reward_model.ground_truth")
    assert [(ex.problem, ex.answer, ex.messages) for ex in got] == [
        ("What is 2+3?", "5", ()), ("Solve x+1=3.", "2", ()), ("Half of 9?", "4.5", ())]
    assert load_dataset(verl_parquet, problem_key="prompt.0.content")[0].problem.startswith("What is 2+3?")


def test_extra_keys_travel_as_plain_msgpack_data(verl_parquet):
    got = load_dataset(verl_parquet, extra_keys=["extra_info.tests", "data_source", "extra_info.index"])
    assert got[2].extras == {"tests": ["assert f(2) == 2"], "data_source": "math_dapo", "index": 2}
    for ex in got:  # what the buffer will send the producers: unchanged by a msgpack round trip
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(ex.extras)) == ex.extras


def test_a_column_named_with_a_dot_wins_over_the_path(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q.text": "flat", "q": {"text": "nested"}, "answer": 1}])
    assert load_dataset(path, problem_key="q.text")[0].problem == "flat"


@pytest.mark.parametrize(
    ("row", "kwargs", "match"),
    [
        ({"prompt": [{"role": "user"}], "answer": 1}, {},
         r"bad\.jsonl:2: 'prompt' is a chat prompt, but its message 1 .*\"role\".*\"content\""),
        ({"prompt": [{"from": "human", "value": "hi"}], "answer": 1}, {}, r"bad\.jsonl:2: .*message 1"),
        ({"prompt": [{"role": "user", "content": ["image", "text"]}], "answer": 1}, {}, r"bad\.jsonl:2: .*message 1"),
        ({"prompt": [{"role": "system", "content": "Be brief."}], "answer": 1}, {},
         r"bad\.jsonl:2: the chat prompt in 'prompt' has no user message"),
        ({"prompt": [], "answer": 1}, {}, r"bad\.jsonl:2: no problem text.*'prompt'.*data\.problem_key"),
        ({"problem": "a", "reward_model": {"style": "rule"}}, {"answer_key": "reward_model.ground_truth"},
         r"bad\.jsonl:2: no answer found \(looked for 'reward_model\.ground_truth'.*data\.answer_key"),
        ({"problem": "a", "answer": 1, "extra_info": {}}, {"extra_keys": ["extra_info.tests"]},
         r"bad\.jsonl:2: no 'extra_info\.tests' in the row.*data\.extra_keys"),
        ({"problem": "a", "answer": 1, "big": 2**70}, {"extra_keys": ["big"]},
         r"bad\.jsonl:2: big is an integer outside 64 bits, which cannot travel to the reward workers"),
        ({"extra_info": {"question": 7}, "answer": 1}, {"problem_key": "extra_info.question"},
         r"bad\.jsonl:2: no problem text \(looked for 'extra_info\.question'"),
    ],
)
def test_bad_rows_in_the_new_formats_name_file_and_line(tmp_path, row, kwargs, match):
    fine = {"problem": "fine", "answer": 1, "reward_model": {"ground_truth": 1}, "big": 1,
            "extra_info": {"tests": 1, "question": "fine"}}
    path = write_jsonl(tmp_path / "bad.jsonl", [fine, row])
    with pytest.raises(DatasetError, match=match):
        load_dataset(path, **kwargs)


# ---- rendering ----


def test_chat_prompts_go_through_the_chat_template():
    tok = FakeChatTokenizer()
    messages = [{"role": "user", "content": "What is 2+3?"}]
    assert render_prompt(messages, "auto", tok) == "<user>What is 2+3?<assistant>"  # no instruction added
    assert render_prompt(messages, "auto", tok, "Be brief.") == "<system>Be brief.<user>What is 2+3?<assistant>"
    own = [{"role": "system", "content": "Mine."}, *messages]
    assert render_prompt(own, "auto", tok, "Be brief.") == "<system>Mine.<user>What is 2+3?<assistant>"
    assert render_prompt("1+2", "auto", tok, "Be brief.").startswith("<system>Be brief.<user>1+2\n")
    multi = [*messages, {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 3+4?"}]
    assert render_prompt(multi, "auto", tok).endswith("<assistant>5<user>And 3+4?<assistant>")


def test_non_chat_templates_render_one_user_message_and_prefix_the_system_text():
    messages = [{"role": "user", "content": " What is 2+3? "}]
    assert render_prompt(messages, "{problem}=") == "What is 2+3?="
    assert render_prompt(messages, "raw", system_prompt="Be brief.") == "Be brief.\n\nWhat is 2+3?"
    assert render_prompt("1+2", "{problem}=", system_prompt="Sum:") == "Sum:\n\n1+2="
    plain = render_prompt(messages, "plain")
    assert plain == render_prompt("What is 2+3?", "plain")
    assert render_prompt(messages, "auto") == plain  # no tokenizer: plain
    own = [{"role": "system", "content": "Mine."}, *messages]
    assert render_prompt(own, "plain", system_prompt="Other.") == f"Mine.\n\n{plain}"
    multi = [*messages, {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 3+4?"}]
    with pytest.raises(ValueError, match=r"roles \['user', 'assistant', 'user'\] needs a chat template.*auto"):
        render_prompt(multi, "plain")


def test_a_real_chat_template_renders_a_verl_row(verl_parquet):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                  unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    cfg = load_config(None, ["--model.path", "/models/x", "--data.system_prompt", "Be brief."])
    first, second, _ = render_examples(cfg, load_dataset(verl_parquet), tok, "dapo")
    assert first.text == f"<|system|>Be brief.<|end|><|user|>What is 2+3? {INSTRUCTION}<|end|><|assistant|>"
    assert second.text.startswith("<|system|>You are a careful solver.<|end|><|user|>Solve x+1=3.")
    assert (first.answer, first.benchmark) == ("5", "dapo")
    tok.chat_template = "{{ raise_exception('System role not supported') }}"
    with pytest.raises(PromptsError, match=r"dapo_train\.parquet:1: the tokenizer's chat template rejected .*System "
                                           r"role not supported.*data\.system_prompt"):
        render_examples(cfg, load_dataset(verl_parquet), tok, "dapo")


def test_a_multi_turn_row_without_a_chat_template_names_its_line(tmp_path):
    row = {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                      {"role": "user", "content": "1+1?"}], "answer": 2}
    path = write_jsonl(tmp_path / "chat.jsonl", [{"problem": "ok", "answer": 1}, row])
    cfg = load_config(None, ["--data.template", "plain"])
    with pytest.raises(PromptsError, match=r"chat\.jsonl:2: a chat prompt with the roles .* needs a chat template"):
        render_examples(cfg, load_dataset(path), None, "chat")


def test_the_buffer_serves_verl_rows_with_their_extras(verl_parquet):
    """build_prompts (what the buffer serves) reads data.* keys, renders, and carries the extras."""
    cfg = load_config(None, ["--data.train_files", f'["{verl_parquet}"]', "--data.eval_files", f'["{verl_parquet}"]',
                             "--data.extra_keys", '["extra_info.tests"]', "--data.template", "{problem}=",
                             "--data.shuffle", "false", "--learner.eval_every", "1"])
    run = build_prompts(cfg, "/nonexistent-model", tokenizer=None)
    assert [p.text for p in run.train] == [f"What is 2+3? {INSTRUCTION}=",
                                           f"You are a careful solver.\n\nSolve x+1=3. {INSTRUCTION}=",
                                           f"Half of 9? {INSTRUCTION}="]
    assert [p.extras for p in run.train] == [{"tests": [f"assert f({i}) == {i}"]} for i in range(3)]
    assert run.evals == []  # every held-out problem is also a training problem


# ---- sources: names, Hugging Face datasets ----


def test_source_and_benchmark_names():
    assert source_name("data/math500.jsonl") == "math500"
    assert source_name("openai/gsm8k:main@test") == "gsm8k"
    assert source_name("/data/saved_ds@train") == "saved_ds"
    assert benchmark_name("arithmetic") == "arithmetic"
    assert benchmark_name("../x/aime24.parquet") == "aime24"


def test_without_datasets_installed_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    (tmp_path / "saved").mkdir()
    for name in (str(tmp_path / "saved"), f"{tmp_path / 'saved'}@test", "openai/gsm8k:main@test"):
        with pytest.raises(DatasetError, match=r"Hugging Face dataset .*`pip install datasets`"):
            load_dataset(name)
        with pytest.raises(DatasetError, match="pip install datasets"):
            check_source(name)
    with pytest.raises(FileNotFoundError, match="data.train_files"):  # a path is never taken for a Hub name
        check_source(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="data.train_files"):
        check_source("data/typo.parquet")


def test_a_dataset_saved_to_disk_loads_with_its_splits(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the optional `datasets` package is not installed "
                                                      "(pip install datasets); loading saved datasets needs it")
    rows = verl_rows()
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "single"))
    got = load_dataset(tmp_path / "single", extra_keys=["extra_info.index"])
    assert [(ex.answer, ex.extras, ex.source) for ex in got] == [("5", {"index": 0}, "single:1"),
                                                                 ("2", {"index": 1}, "single:2"),
                                                                 ("4.5", {"index": 2}, "single:3")]
    assert got[1].messages == tuple(rows[1]["prompt"])
    assert load_dataset(tmp_path / "single", problem_key="extra_info.question")[0].problem == "What is 2+3?"
    with pytest.raises(DatasetError, match="single dataset without splits; drop the @test"):
        load_dataset(f"{tmp_path / 'single'}@test")

    datasets.DatasetDict({"train": ds, "test": ds.select([2])}).save_to_disk(str(tmp_path / "dict"))
    assert [ex.answer for ex in load_dataset(f"{tmp_path / 'dict'}@test")] == ["4.5"]
    with pytest.raises(DatasetError, match=r"dict: several splits; choose one of \['test', 'train'\] with .*@SPLIT"):
        load_dataset(tmp_path / "dict")
    bad = datasets.Dataset.from_list([{"problem": "a", "answer": "1"}, {"problem": "b", "answer": None}])
    bad.save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(DatasetError, match=r"bad:2: no answer found"):
        load_dataset(tmp_path / "bad")
    cfg = load_config(None, ["--data.eval_files", f'["{tmp_path / "dict"}@test"]'])
    assert [ex.source for ex in load_examples(cfg, f"{tmp_path / 'dict'}@test", train=False)] == ["dict@test:1"]


# ---- config ----


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["--data.extra_keys", '["info.answer"]'], r"data\.extra_keys: 'info\.answer' would be passed as 'answer'"),
        (["--data.extra_keys", '["a.tests", "b.tests"]'], r"data\.extra_keys: two entries end in 'tests'"),
        (["--data.extra_keys", '["info.my-tests"]'], r"data\.extra_keys: 'info\.my-tests' must be .*Python name"),
        (["--data.extra_keys", '["info."]'], r"data\.extra_keys: 'info\.' must be"),
        (["--reward.fn", "pipeline.rewards.math.verify"], r"reward\.fn: .* must be \"package\.module:function\""),
    ],
)
def test_bad_data_and_reward_settings(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_examples_compare_and_default_as_before():
    assert Example("p", "1") == Example("p", "1", "", (), {})
    assert Example("p", "1").messages == () and Example("p", "1").extras == {}
