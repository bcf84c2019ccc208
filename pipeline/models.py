"""Where a run's model lives: `model.path = "tiny"` means the locally built tiny arithmetic model."""

from __future__ import annotations

from pathlib import Path

from pipeline.config import Config, ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_DIR = REPO_ROOT / ".cache" / "tiny-model"


def resolve_model_path(cfg: Config, build: bool = True) -> str:
    """The model directory of `cfg`, building the tiny model on first use when `model.path == "tiny"`."""
    if cfg.model.path == "tiny":
        if build:
            from pipeline.tiny_model import ensure_tiny_model

            return str(ensure_tiny_model(TINY_DIR, seed=0))
        return str(TINY_DIR)
    path = Path(cfg.model.path).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model.path: {cfg.model.path!r} is not a Hugging Face model directory (no config.json). Nothing is "
            "downloaded at run time: download the model first (e.g. `huggingface-cli download NAME --local-dir "
            "DIR`) and set model.path = DIR, or use model.path = \"tiny\"."
        )
    return str(path)


def tokenizer_path(cfg: Config, model_dir: str) -> str:
    return cfg.model.tokenizer or model_dir

TINY_TEMPLATE = "{problem}="  # the tiny model was trained on "12+34=" -> "46"


def prompt_template(cfg: Config) -> str:
    """data.template, except that "auto" on the tiny model means the format it was trained on."""
    if cfg.data.template == "auto" and cfg.model.path == "tiny":
        return TINY_TEMPLATE
    return cfg.data.template


def load_tokenizer_if_needed(cfg: Config, model_dir: str):
    """The tokenizer when the template needs its chat template, else None (saves loading transformers)."""
    if prompt_template(cfg) != "auto":
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path(cfg, model_dir))
