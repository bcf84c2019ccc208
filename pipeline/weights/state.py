"""A model's state as it is published and exported: Hugging Face names, tied duplicates dropped, contiguous CPU
tensors. The learner's backends (consumer/backends/) publish through it and `reinforce-ada export` (export.py)
writes checkpoints through it, so both sides of the model's weights agree on names and ties."""

from __future__ import annotations

import torch


def dedup_tied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the second name of a tied tensor (safetensors refuses shared storage; vLLM re-ties on load)."""
    out, seen = {}, {}
    for name, t in state.items():
        key = (t.data_ptr(), t.shape, t.dtype) if t.numel() else None
        if key is not None and key in seen:
            continue
        seen[key] = name
        out[name] = t
    return out


def to_publish(state: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`state` without `prefix` in its names, tied duplicates dropped, as contiguous CPU tensors in `dtype`
    (integer tensors keep theirs)."""
    out = {}
    for name, t in state.items():
        name = name[len(prefix):] if name.startswith(prefix) else name
        out[name] = t.detach()
    out = dedup_tied(out)
    return {k: v.to(device="cpu", dtype=dtype if v.is_floating_point() else v.dtype).contiguous()
            for k, v in out.items()}
