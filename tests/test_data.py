"""Datasets: the four benchmark files, JSONL/Parquet loading, bad rows, dedup, \\boxed{}, prompt templates."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipeline.data import (
    DatasetError,
    Example,
    last_boxed,
    load_dataset,
    make_arithmetic,
    normalize_answer,
    render_prompt,
    validate_template,
)

BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "benchmarks"
EXPECTED_COUNTS = {"math500": 500, "aime24": 30, "amc23": 40, "minerva_math": 272}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ---- the real benchmark files ----


@pytest.mark.parametrize("name", list(EXPECTED_COUNTS))
def test_benchmark_files_load_with_expected_counts(name):
    examples = load_dataset(BENCH / f"{name}.jsonl")
    print(f"{name}: {len(examples)} examples")
    assert len(examples) == EXPECTED_COUNTS[name]
    assert len(load_dataset(BENCH / f"{name}.jsonl", dedup=False)) == EXPECTED_COUNTS[name]
    assert all(ex.problem and ex.answer for ex in examples)
    assert examples[0].source == f"{name}.jsonl:1"
    assert examples[-1].source == f"{name}.jsonl:{EXPECTED_COUNTS[name]}"


def test_benchmark_answers_are_normalised():
    amc = load_dataset(BENCH / "amc23.jsonl")
    assert [ex.answer for ex in amc[:4]] == ["27", "36", "45", "3159"]  # floats 27.0 ... in the file
    assert load_dataset(BENCH / "aime24.jsonl")[7].answer == "025"  # strings are kept as written
    minerva = load_dataset(BENCH / "minerva_math.jsonl")  # no answer field: last \boxed{} of solution
    assert [ex.answer for ex in minerva[:3]] == ["1.6", "4.5e33", "41.8"]


def test_last_boxed_recovers_every_math500_answer():
    rows = [json.loads(line) for line in (BENCH / "math500.jsonl").read_text().splitlines()]
    assert sum(last_boxed(r["solution"]) == r["answer"] for r in rows) == 500


# ---- \boxed{} extraction ----


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\fbox{7}", "7"),
        ("$\\framebox{204}$ minutes", "204"),
        ("\\boxed {x+1}", "x+1"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces are content, not structure
        ("\\boxed{\\left\\{ a \\right.}", "\\left\\{ a \\right."),
        ("\\boxed{3} and a cut-off \\boxed{\\frac{1}{", "3"),  # the last complete one
        ("no box here", None),
        ("\\boxed{unclosed", None),
        ("", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_last_boxed_is_fast_on_a_megabyte():
    assert last_boxed("\\boxed{" * 150_000) is None
    assert last_boxed("{" * 1_000_000 + "\\boxed{5}") == "5"


# ---- loading files ----


def test_jsonl_round_trip_with_custom_keys(tmp_path):
    rows = [
        {"q": " What is 1+1? ", "a": 2},
        {"q": "Half of one?", "a": 0.5},
        {"q": "Roots of x^2=1?", "a": [-1, 1]},
    ]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    assert load_dataset(path, problem_key="q", answer_key="a") == [
        Example("What is 1+1?", "2", "t.jsonl:1"),
        Example("Half of one?", "0.5", "t.jsonl:2"),
        Example("Roots of x^2=1?", "-1, 1", "t.jsonl:3"),
    ]
    exs = [Example(f"p{i}", str(i), "") for i in range(5)]
    path = write_jsonl(tmp_path / "w.jsonl", [{"problem": e.problem, "answer": e.answer} for e in exs])
    assert [(e.problem, e.answer) for e in load_dataset(path)] == [(e.problem, e.answer) for e in exs]


def test_answer_from_solution_and_explicit_keys(tmp_path):
    rows = [{"q": "x?", "answer": 1}, {"q": "y?", "sol": "We get \\boxed{1}, so \\boxed{\\frac{a}{b}}."}]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    got = load_dataset(path, problem_key="q", solution_key="sol")
    assert [ex.answer for ex in got] == ["1", "\\frac{a}{b}"]
    # an explicit answer_key is the only place looked at: no fallback to the solution
    with pytest.raises(DatasetError, match=r"t\.jsonl:2: no answer found .*'answer'.*data\.answer_key"):
        load_dataset(path, problem_key="q", answer_key="answer", solution_key="sol")
    with pytest.raises(DatasetError, match=r"t\.jsonl:1: no problem text .*'problem' or 'question'"):
        load_dataset(path)


def test_parquet_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed; Parquet loading needs pyarrow")
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "question": ["What is 2+2?", "what is  2+2?", "Solve x."],
            "final_answer": [4.0, 4.0, None],
            "solution": ["", "", "so \\boxed{x=3}"],
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    got = load_dataset(tmp_path / "t.parquet")
    assert got == [Example("What is 2+2?", "4", "t.parquet:1"), Example("Solve x.", "x=3", "t.parquet:3")]


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        (['{"problem": "a", "answer": 1}', "{not json"], r"bad\.jsonl:2: invalid JSON"),
        (['{"problem": "a", "answer": 1}', "[1, 2]"], r"bad\.jsonl:2: expected a JSON object.*list"),
        (['{"text": "a", "answer": 1}'], r"bad\.jsonl:1: no problem text.*data\.problem_key"),
        (['{"problem": "a"}'], r"bad\.jsonl:1: no answer found.*data\.answer_key"),
        (['{"problem": "a", "answer": ""}'], r"bad\.jsonl:1: no answer found"),
        (['{"problem": "a", "solution": "no box"}'], r"bad\.jsonl:1: no answer found.*\\boxed"),
        (['{"problem": "a", "answer": true}'], r"bad\.jsonl:1: no answer found"),
        (["", "  "], r"bad\.jsonl: no examples"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, lines, match):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DatasetError, match=match):
        load_dataset(path)


def test_bad_paths_and_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.train_files"):
        load_dataset(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("problem,answer\n")
    with pytest.raises(DatasetError, match=r"unsupported file type '\.csv'"):
        load_dataset(tmp_path / "x.csv")
    ok = write_jsonl(tmp_path / "ok.jsonl", [{"problem": "a", "answer": 1}])
    with pytest.raises(ValueError, match="limit"):
        load_dataset(ok, limit=0)


def test_dedup_and_limit(tmp_path):
    rows = [
        {"problem": "What is  1+1?", "answer": "2"},
        {"problem": "what is 1+1?\n", "answer": "2"},  # same after whitespace and case folding
        {"problem": "What is 1+2?", "answer": "3"},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    got = load_dataset(path)
    assert [ex.source for ex in got] == ["d.jsonl:1", "d.jsonl:3"]
    assert len(load_dataset(path, dedup=False)) == 3
    assert [ex.answer for ex in load_dataset(path, limit=1)] == ["2"]
    assert [ex.answer for ex in load_dataset(path, dedup=False, limit=2)] == ["2", "2"]


def test_normalize_answer():
    assert normalize_answer(27.0) == "27"
    assert normalize_answer(-3) == "-3"
    assert normalize_answer(0.25) == "0.25"
    assert normalize_answer([1, 2.0, "x"]) == "1, 2, x"
    assert normalize_answer(" \\frac{1}{2} ") == "\\frac{1}{2}"
    assert normalize_answer(float("nan")) is None
    assert normalize_answer(None) is None
    assert normalize_answer([]) is None


# ---- prompt templates ----


class FakeChatTokenizer:
    """A test double with just what render_prompt uses."""

    chat_template = "set"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_named_templates():
    assert render_prompt("1+2", "raw") == "1+2"
    assert render_prompt("1+2", "{problem}=") == "1+2="
    assert render_prompt("x {y}", "Q: {problem}\nA:") == "Q: x {y}\nA:"  # braces in the problem are fine
    plain = render_prompt("What is 1+2?", "plain")
    assert "What is 1+2?" in plain and "\\boxed{}" in plain
    assert render_prompt("What is 1+2?", "auto") == plain  # no tokenizer: plain
    chat = render_prompt("What is 1+2?", "auto", FakeChatTokenizer())
    assert chat.startswith("<user>What is 1+2?") and "\\boxed{}" in chat and chat.endswith("<assistant>")
    no_template = FakeChatTokenizer()
    no_template.chat_template = None
    assert render_prompt("What is 1+2?", "auto", no_template) == plain


def test_auto_template_with_a_real_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    assert render_prompt("P?", "auto", tok) == render_prompt("P?", "plain")  # no chat template yet
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    text = render_prompt("P?", "auto", tok)
    assert text.startswith("<|user|>P?\n") and "\\boxed{}" in text and text.endswith("<|end|><|assistant|>")


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("chat", r"unknown prompt template 'chat'.*'auto', 'plain', 'raw'"),
        ("{question}=", "unknown prompt template"),
        ("{problem} in \\boxed{}", r"only use the field \{problem\}"),
        ("{problem} {", "not a valid format string"),
    ],
)
def test_bad_templates(template, match):
    with pytest.raises(ValueError, match=match):
        validate_template(template)
    with pytest.raises(ValueError, match=match):
        render_prompt("p", template)
    validate_template("{problem} in \\boxed{{}}")  # escaped braces are fine


# ---- the arithmetic generator ----


def test_arithmetic_is_deterministic_and_correct():
    a, b = make_arithmetic(200, seed=3), make_arithmetic(200, seed=3)
    assert a == b
    assert a != make_arithmetic(200, seed=4)
    assert len({ex.problem for ex in a}) == 200
    for ex in a:
        assert str(eval(ex.problem)) == ex.answer  # "12+7" style strings we generated
    assert {ex.source for ex in make_arithmetic(50, levels=(1,))} == {"arithmetic:L1"}
    with pytest.raises(ValueError, match="level"):
        make_arithmetic(5, levels=(4,))
    with pytest.raises(ValueError, match="distinct"):
        make_arithmetic(500, levels=(1,))  # only 200 distinct 1-digit problems exist


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    for mod in ("pyarrow", "pyarrow.parquet", "pandas"):
        monkeypatch.setitem(sys.modules, mod, None)  # makes `import mod` raise ImportError
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    with pytest.raises(DatasetError, match=r"t\.parquet: reading Parquet needs pyarrow.*pip install pyarrow"):
        load_dataset(tmp_path / "t.parquet")
