"""Reading a dataset: JSONL and Parquet files, and Hugging Face datasets (a directory written by `save_to_disk`, or
a Hub name) when the optional `datasets` package is installed.

A data.train_files / data.eval_files entry is, in this order of precedence:
- an existing file: `.jsonl` / `.ndjson` (one JSON object per line) or `.parquet`;
- an existing directory: `datasets.load_from_disk`;
- a name with a dataset-file suffix, or a path (absolute, `./`, `../`, `~`): a missing file (an error);
- anything else: a Hugging Face Hub dataset, `NAME[:CONFIG]` (`datasets.load_dataset`, which may download).
A directory or Hub name may end in `@SPLIT`; without it, a dataset with one split uses that split, and one with
several is an error that lists them.

Invariant: loading never silently drops a row: a bad row is a DatasetError naming file:line (for a Hugging Face
dataset, NAME@SPLIT:ROW, 1-based); only exact duplicates (whitespace and case ignored) are dropped, and only
when dedup is on. `datasets` is imported only when an entry needs it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from pipeline.data.answers import normalize_problem
from pipeline.data.rows import DatasetError, Example, row_to_example

DATASET_SUFFIXES = (".jsonl", ".ndjson", ".parquet")
INSTALL_DATASETS = "pip install datasets"


def _looks_like_path(name: str) -> bool:
    return name.lower().endswith(DATASET_SUFFIXES) or name.startswith(("/", "./", "../", "~"))


def _split_suffix(name: str) -> tuple[str, str | None]:
    """("data/dir", "test") for "data/dir@test"; the name as it is when it has no @SPLIT."""
    base, sep, split = name.rpartition("@")
    return (base, split) if sep and base and split and "/" not in split else (name, None)


def source_name(name: str) -> str:
    """The short name of a dataset entry, for Example.source and benchmark names: "math500" for
    "data/math500.jsonl", "gsm8k" for "openai/gsm8k:main@test"."""
    base = _split_suffix(name)[0]
    if not Path(base).expanduser().exists() and not _looks_like_path(base):
        base = base.split(":", 1)[0]  # a Hub name's :CONFIG
    return Path(base).stem


def check_source(name: str) -> None:
    """Raise FileNotFoundError or DatasetError now if `name` cannot be read (no file, no `datasets` package),
    without reading it; a Hub name is only checked when it is loaded."""
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() not in DATASET_SUFFIXES:
            raise DatasetError(f"{path}: unsupported file type {path.suffix.lower()!r}; use one of {DATASET_SUFFIXES}"
                               ", a directory saved with datasets' save_to_disk, or a Hugging Face dataset name")
        return
    base = _split_suffix(name)[0]
    if not Path(base).expanduser().is_dir() and _looks_like_path(base):
        raise FileNotFoundError(f"dataset file not found: {name}; check data.train_files and data.eval_files")
    _import_datasets(name)


def _import_datasets(name: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise DatasetError(
            f"{name}: not a file, so it is read as a Hugging Face dataset (a directory written by save_to_disk, or a "
            f"Hub name), which needs the optional `datasets` package: `{INSTALL_DATASETS}`; or give a "
            f"{'/'.join(DATASET_SUFFIXES)} file"
        ) from None
    return datasets


def _read_file(path: Path) -> Iterator[tuple[str, Any]]:
    """(file:line, decoded row) for a JSONL or Parquet file (Parquet: the 1-based row)."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        with path.open("r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{lineno}", json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetError(
                        f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno}); "
                        "each line of a .jsonl file must be one JSON object"
                    ) from None
    elif suffix == ".parquet":
        for row, record in enumerate(_read_parquet(path), 1):
            yield f"{path}:{row}", record
    else:
        raise DatasetError(f"{path}: unsupported file type {suffix!r}; use one of {DATASET_SUFFIXES}, a directory "
                           "saved with datasets' save_to_disk, or a Hugging Face dataset name")


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        pq = None
    if pq is not None:
        return pq.read_table(path).to_pylist()
    try:
        import pandas as pd
    except ImportError:
        raise DatasetError(
            f"{path}: reading Parquet needs pyarrow (or pandas with a Parquet engine); "
            "install it with `pip install pyarrow`, or convert the file to JSONL"
        ) from None
    return pd.read_parquet(path).to_dict("records")


def _read_hf(name: str) -> Iterator[tuple[str, Any]]:
    """(NAME@SPLIT:ROW, row) of a dataset directory or Hub dataset."""
    datasets = _import_datasets(name)
    base, split = _split_suffix(name)
    if Path(name).expanduser().is_dir():
        base, split = name, None
    local = Path(base).expanduser()
    try:
        if local.is_dir():
            data = datasets.load_from_disk(str(local))
        else:  # a Hub dataset: only the split asked for (all of them without @SPLIT, to choose below)
            hub, _, config = base.partition(":")
            data = datasets.load_dataset(hub, config or None, split=split)
    except Exception as e:  # noqa: BLE001 -- whatever datasets raises, the user needs the entry and the cause
        raise DatasetError(f"{name}: Hugging Face datasets could not load it ({type(e).__name__}: {e}); check "
                           "data.train_files and data.eval_files") from None
    if isinstance(data, datasets.DatasetDict):
        if split is None and len(data) == 1:
            split = next(iter(data))
        if split not in data:
            raise DatasetError(f"{name}: {'no split ' + repr(split) if split else 'several splits'}; choose one of "
                               f"{sorted(data)} with {base}@SPLIT")
        data = data[split]
    elif split is not None and local.is_dir():
        raise DatasetError(f"{name}: {base} holds a single dataset without splits; drop the @{split}")
    where = f"{base}@{split}" if split else base
    for row, record in enumerate(data, 1):
        yield f"{where}:{row}", record


def short_source(where: str) -> str:
    """Example.source for a row that read_rows names `where`: "/data/t.jsonl:17" -> "t.jsonl:17"."""
    origin, row_number = where.rsplit(":", 1)
    return f"{Path(origin).name}:{row_number}"


def read_rows(name: str | Path) -> Iterator[tuple[str, Any]]:
    """(where, decoded row) for every row of a dataset entry, in order; see the module docstring."""
    path = Path(name).expanduser()
    check_source(str(name))
    return _read_file(path) if path.is_file() else _read_hf(str(name))


def load_dataset(
    path: str | Path,
    problem_key: str | None = None,
    answer_key: str | None = None,
    solution_key: str | None = None,
    dedup: bool = True,
    limit: int | None = None,
    extra_keys: Sequence[str] = (),
) -> list[Example]:
    """Examples from a JSONL or Parquet file (or a Hugging Face dataset: see the module docstring), in order.

    The problem is `problem_key`, else "problem", "question" or "prompt": a string, or a list of chat messages
    (verl's format). The answer is `answer_key`, else "answer", "final_answer" or "reward_model.ground_truth",
    else the last \\boxed{} of `solution_key` (default "solution"). Keys may be dotted paths into nested
    columns. Numbers and lists become strings (27.0 -> "27"). `extra_keys` are carried in Example.extras under
    their last dotted part. With `dedup`, later rows whose problem equals an earlier one (whitespace and case
    ignored) are dropped. `limit` keeps the first `limit` examples after dedup.
    Each Example.source is "file.jsonl:LINE" (Parquet and datasets: the 1-based row). Raises DatasetError naming
    file:line for a bad row, and for a dataset with no rows.
    """
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    out: list[Example] = []
    seen: set[str] = set()
    for where, row in read_rows(path):
        ex = row_to_example(row, where, problem_key, answer_key, solution_key, extra_keys)
        ex = msgspec.structs.replace(ex, source=short_source(where))
        if dedup:
            key = normalize_problem(ex.problem)
            if key in seen:
                continue
            seen.add(key)
        out.append(ex)
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise DatasetError(f"{path}: no examples in the dataset; check data.train_files and data.eval_files")
    return out
