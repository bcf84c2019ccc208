"""Hugging Face export: the learner's weights as a model directory that `transformers.from_pretrained` and vLLM
load as they are.

    reinforce-ada export CKPT [--out DIR] [--model DIR] [--dtype D]

CKPT is a checkpoint directory (`run_dir/checkpoints/step_N`) or a run directory (its latest checkpoint); the
weights come from its `torch_state.pt` or its DeepSpeed ZeRO shards (gathered in this one process), the model
config and tokenizer from the run's model (`model.path` / `model.tokenizer` of `run_dir/config.toml`, or
--model). Without --out the export goes to CKPT/hf, where the learner writes it for every new checkpoint.

What an export directory holds, and its invariants, are hf.py's (`write_hf`, which the learner writes every
checkpoint's hf/ with too). This module is a leaf: users (and `reinforce-ada eval`) call it after training;
nothing on the training path imports it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.hf import HF_DIR, ExportError, HfSource, latest_checkpoint, write_hf

if TYPE_CHECKING:
    import torch

    from pipeline.config import Config

DTYPES = ("float32", "bfloat16", "float16")  # what --dtype offers

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
