"""Hugging Face export: the learner's weights as a model directory that `transformers.from_pretrained` and vLLM
load as they are.

    reinforce-ada export CKPT [--out DIR] [--model DIR] [--dtype D]

CKPT is a checkpoint directory (`run_dir/checkpoints/step_N`) or a run directory (its latest checkpoint); the
weights come from its `torch_state.pt` or its DeepSpeed ZeRO shards (gathered in this one process), the model
config and tokenizer from the run's model (`model.path` / `model.tokenizer` of `run_dir/config.toml`, or
--model). Without --out the export goes to CKPT/hf, where the learner writes it for every new checkpoint.

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

import argparse
import json
import os
import shutil
import sys
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
DTYPES = ("float32", "bfloat16", "float16")


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


# ---------------------------------------------------------------- existing checkpoints


def checkpoint_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """The HF-named float32 weights of a learner checkpoint (torch_state.pt, or DeepSpeed shards gathered here),
    tied duplicates dropped."""
    import torch

    from pipeline.weights.state import to_publish

    if (ckpt / "torch_state.pt").is_file():
        state = torch.load(ckpt / "torch_state.pt", map_location="cpu", weights_only=True)["model"]
        return to_publish(state, "", torch.float32)
    ds_dir = ckpt / "deepspeed"
    if not ds_dir.is_dir():
        raise ExportError(f"{ckpt} holds neither torch_state.pt nor deepspeed/: not a learner checkpoint")
    if any(ds_dir.glob("*optim_states.pt")):  # ZeRO-1/2/3: the float32 master weights are in the shards
        try:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        except ImportError:
            raise ExportError(f"{ckpt} holds DeepSpeed ZeRO shards: install deepspeed to gather them "
                              "(pip install 'reinforce-ada[deepspeed]')") from None
        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="deepspeed")
    else:  # ZeRO-0: the module's full state
        state = torch.load(ds_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)["module"]
    return to_publish(state, "lm.", torch.float32)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root` (a run's checkpoints/), or None."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if (path / "meta.json").is_file() else None


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint a path names: a checkpoint directory itself, or a run directory's latest checkpoint."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    for root in (path / "checkpoints", path):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise ExportError(f"{path} is neither a learner checkpoint (no meta.json) nor a run directory with "
                      "checkpoints/latest")


def run_config_file(ckpt: Path) -> Path | None:
    """The config.toml of the run a checkpoint belongs to (run_dir/checkpoints/step_N), or None."""
    found = [d / "config.toml" for d in (ckpt.parent.parent, ckpt.parent) if (d / "config.toml").is_file()]
    return found[0] if found else None


def run_config(ckpt: Path) -> Config | None:
    """The config of the run a checkpoint belongs to, or None when there is none."""
    from pipeline.config import load_config

    path = run_config_file(ckpt)
    return load_config(str(path), []) if path is not None else None


def latest_export(run_dir: str | Path) -> Path:
    """The export of a run directory's latest checkpoint; an ExportError says how to make one if it is missing."""
    ckpt = find_checkpoint(run_dir)
    hf = ckpt / HF_DIR
    if not (hf / "config.json").is_file():
        raise ExportError(f"{ckpt} has no Hugging Face export ({HF_DIR}/): make it with `reinforce-ada export {ckpt}`")
    return hf


def find_run_export(path: str | Path) -> tuple[Path, str | None] | None:
    """For a run or checkpoint directory: (its latest export, the run's config.toml or None); None for anything
    else (a model directory, "tiny"). An ExportError when the checkpoint has no export yet."""
    path = Path(path)
    if (path / "config.json").is_file() or not ((path / "meta.json").is_file() or (path / "checkpoints").is_dir()):
        return None
    hf = latest_export(path)
    config = run_config_file(hf.parent)
    return hf, (str(config) if config is not None else None)


def export_checkpoint(ckpt: str | Path, out: str | Path | None = None, model_dir: str | Path | None = None,
                      dtype: str | None = None) -> Path:
    """Export a checkpoint (or a run's latest); returns the export directory."""
    from pipeline.models import resolve_model_path

    ckpt = find_checkpoint(ckpt)
    cfg = run_config(ckpt)
    if model_dir is None:
        if cfg is None:
            raise ExportError(f"no config.toml of the run beside {ckpt}: pass --model DIR (the run's model "
                              "directory, for its config and tokenizer)")
        model_dir = resolve_model_path(cfg, build=False)
    tokenizer_dir = Path(cfg.model.tokenizer) if cfg is not None and cfg.model.tokenizer else Path(model_dir)
    dtype = dtype or (cfg.model.dtype if cfg is not None else "float32")
    source = HfSource(Path(model_dir), tokenizer_dir, dtype)
    return write_hf(checkpoint_state(ckpt), Path(out) if out else ckpt / HF_DIR, source)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="reinforce-ada export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", metavar="CKPT", help="a checkpoint directory, or a run directory (its latest)")
    parser.add_argument("--out", help="export directory (default: CKPT/hf)")
    parser.add_argument("--model", help="model directory for config.json and the tokenizer (default: the run's "
                                        "model.path)")
    parser.add_argument("--dtype", choices=DTYPES, help="weights dtype (default: the run's model.dtype)")
    args = parser.parse_args(argv)
    from pipeline.config import ConfigError

    try:
        out = export_checkpoint(args.checkpoint, args.out, args.model, args.dtype)
    except (ExportError, ConfigError, OSError) as exc:
        print(f"export: {exc}", file=sys.stderr)
        return 2
    print(f"exported {find_checkpoint(args.checkpoint)} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
