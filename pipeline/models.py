"""Where a run's model lives: `model.path = "tiny"` means the locally built tiny arithmetic model,
`"smollm2-135m"` or a `.gguf` file a real pretrained model converted once (`pipeline.pretrained`), anything else a
Hugging Face model directory."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pipeline.config import Config, ConfigError

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_DIR = REPO_ROOT / ".cache" / "tiny-model"


def resolve_model_path(cfg: Config, build: bool = True) -> str:
    """The model directory of `cfg`, building the tiny model on first use when `model.path == "tiny"`."""
    if cfg.model.path == "tiny":
        if build:
            from pipeline.tiny_model import ensure_tiny_model

            return str(ensure_tiny_model(TINY_DIR, seed=0))
        return str(TINY_DIR)
    from pipeline.pretrained import resolve_pretrained

    converted = resolve_pretrained(cfg.model.path)  # a built-in name or a .gguf file: converted once, then cached
    if converted is not None:
        return str(converted)
    path = Path(cfg.model.path).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model.path: {cfg.model.path!r} is not a Hugging Face model directory (no config.json). Nothing is "
            "downloaded at run time: download the model first (e.g. `huggingface-cli download NAME --local-dir "
            "DIR`) and set model.path = DIR, or name a .gguf file, or use model.path = \"tiny\" or \"smollm2-135m\"."
        )
    return str(path)


def tokenizer_path(cfg: Config, model_dir: str) -> str:
    return cfg.model.tokenizer or model_dir

TINY_TEMPLATE = "{problem}="  # the tiny model was trained on "12+34=" -> "46"


def prompt_template(cfg: Config, tokenizer: Any = None) -> str:
    """data.template, where "auto" means the model's own format: its chat template whenever its tokenizer has
    one (whatever model.path says: `eval --model DIR` of a chat model renders chat prompts); else the format the
    tiny model was trained on, for the tiny model (model.path "tiny", or a directory the tiny builder wrote);
    else "auto" (rendered as "plain")."""
    from pipeline.data.templates import has_chat_template

    if cfg.data.template != "auto" or has_chat_template(tokenizer):
        return cfg.data.template
    if cfg.model.path == "tiny" or _is_tiny_dir(getattr(tokenizer, "name_or_path", "")):
        return TINY_TEMPLATE
    return cfg.data.template


def _is_tiny_dir(path: str) -> bool:
    from pipeline.tiny_model import STATS_FILE

    return bool(path) and (Path(path) / STATS_FILE).is_file()


def load_tokenizer(cfg: Config, model_dir: str) -> Any:
    """The run's tokenizer, or None when the directory holds none (a scripted run without a model).

    A directory that holds a tokenizer which fails to load is an error: the prompts could not be rendered
    or counted the way the engines will."""
    path = Path(tokenizer_path(cfg, model_dir))
    if not path.is_dir() or not any((path / f).is_file() for f in TOKENIZER_FILES):
        if prompt_template(cfg) == "auto" and cfg.model.path != "tiny":
            raise ConfigError(f"model.tokenizer: no tokenizer in {path} (looked for {', '.join(TOKENIZER_FILES)}); "
                              "data.template = \"auto\" needs the model's chat template")
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def model_max_len(model_dir: str) -> int | None:
    """The model's own context length (max_position_embeddings), or None when it is unknown or RoPE-scaled."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config") or config
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default":
        return None  # scaled RoPE: vLLM may allow more than max_position_embeddings, let it decide
    value = config.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


def effective_max_model_len(cfg: Config, model_dir: str) -> int:
    """producers.engine.max_model_len clamped to the model's own limit (vLLM refuses more than the model's)."""
    max_len = cfg.producers.engine.max_model_len
    limit = model_max_len(model_dir)
    return min(max_len, limit) if limit is not None else max_len
