"""The trained model on disk, below both the learner that writes it and the tools that read it: a Hugging Face
model directory written from a published state (`write_hf`: what every checkpoint's hf/ holds, and what
`reinforce-ada export` rebuilds from an older checkpoint), and the pointer to a run's newest checkpoint
(`latest_checkpoint`). Torch is imported only to write weights, so the supervisor reads the pointer without it.

An export directory holds:
    config.json              the run's model config, its dtype set to the export's
    generation_config.json   the model's own (else the config's bos/eos/pad token ids)
    model.safetensors        HF parameter names; above SHARD_BYTES, model-0000i-of-0000n.safetensors shards and
                             model.safetensors.index.json
    tokenizer files          copied as the model's tokenizer directory holds them (chat template included)

Invariants: an export is complete or absent (written into a temp directory beside it, then renamed); a tied
model (`tie_word_embeddings`) holds its embedding once and no `lm_head.weight`, which transformers and vLLM
re-tie on load; files are readable by other users (0644), as a shared model directory must be.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pipeline.config import Config

HF_DIR = "hf"  # an export's name inside a checkpoint directory
LATEST = "latest"  # checkpoints/latest: the name of the newest complete checkpoint (see consumer/checkpoint.py)
SHARD_BYTES = 5 << 30  # larger models are written in shards of at most this size (transformers' default)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json")
TOKENIZER_DIRS = ("additional_chat_templates",)


class ExportError(ValueError):
    """A checkpoint or model directory that cannot be exported; the message says which and what to do."""


@dataclass(frozen=True)
class HfSource:
    """Where an export's config and tokenizer come from, and the dtype of its weights."""

    model_dir: Path
    tokenizer_dir: Path
    dtype: str = "float32"

    @classmethod
    def of(cls, cfg: Config, model_dir: str | Path | None = None) -> HfSource:
        """The source of run `cfg` (its model directory already resolved by the caller when given)."""
        model = Path(model_dir if model_dir is not None else cfg.model.path)
        return cls(model, Path(cfg.model.tokenizer) if cfg.model.tokenizer else model, cfg.model.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)


def write_hf(state: dict[str, torch.Tensor], out_dir: str | Path, source: HfSource) -> Path:
    """Write `state` (HF names, CPU tensors, tied duplicates already dropped) as an export at `out_dir`."""
    out = Path(out_dir)
    config_file = source.model_dir / "config.json"
    if not config_file.is_file():
        raise ExportError(f"{source.model_dir} is not a Hugging Face model directory (no config.json): the export "
                          "takes its config from the run's model; pass --model DIR")
    if not state:
        raise ExportError("refusing to export an empty state dict")
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        config = json.loads(config_file.read_text())
        _set_dtype(config, source.dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _write_generation_config(source.model_dir, config, tmp)
        _copy_tokenizer(source.tokenizer_dir, config, source.model_dir, tmp)
        _write_weights(state, source.torch_dtype, tmp)
        for path in tmp.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out.exists():  # a rebuilt export replaces the old one
            old = out.parent / f".old-{out.name}-{os.getpid()}"
            os.replace(out, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _set_dtype(config: dict, dtype: str) -> None:
    # transformers >= 4.56 writes "dtype", older versions "torch_dtype": set what the file uses (both if both)
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype", "torch_dtype"]
    for key in keys:
        config[key] = dtype
    text = config.get("text_config")
    if isinstance(text, dict):
        _set_dtype(text, dtype)


def _write_generation_config(model_dir: Path, config: dict, out: Path) -> None:
    source = model_dir / "generation_config.json"
    if source.is_file():
        shutil.copyfile(source, out / "generation_config.json")
        return
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _copy_tokenizer(tokenizer_dir: Path, config: dict, model_dir: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out / name)
    for name in TOKENIZER_DIRS:
        if (tokenizer_dir / name).is_dir():
            shutil.copytree(tokenizer_dir / name, out / name)
    if "auto_map" in config:  # trust_remote_code models: their code files travel with the config
        for path in model_dir.glob("*.py"):
            shutil.copyfile(path, out / path.name)


def _write_weights(state: dict[str, torch.Tensor], dtype: torch.dtype, out: Path) -> None:
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    tensors = {k: v.detach().to(device="cpu", dtype=dtype if v.is_floating_point() else v.dtype).contiguous()
               for k, v in state.items()}
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=SHARD_BYTES)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: tensors[n] for n in names}, str(out / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root` (a run's checkpoints/), or None."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if (path / "meta.json").is_file() else None
