"""Tiny models written to disk for tests and benchmarks."""

from __future__ import annotations

from pathlib import Path


def save_random_llama(path, *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int = 32,
                      intermediate: int, max_positions: int | None = None, tied: bool = False, seed: int | None = 0,
                      **config) -> Path:
    """A randomly initialised LlamaForCausalLM saved to `path` (no tokenizer). torch is seeded with `seed` first
    (None: left as it is). `max_positions` None keeps LlamaConfig's default; `config` goes to LlamaConfig as is."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    if max_positions is not None:
        config["max_position_embeddings"] = max_positions
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
                      tie_word_embeddings=tied, **config)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return Path(path)


def save_sharpened_tiny(path, seed: int = 0, sharpen: float = 10.0) -> Path:
    """pipeline.tiny_model's model and tokenizer, random (torch seeded with `seed`) with lm_head scaled by `sharpen`:
    peaked, not uniform, next-token distributions (x10: top-1 ~0.4) and clear greedy choices."""
    import torch

    from pipeline.tiny_model import make_model, make_tokenizer

    torch.manual_seed(seed)
    tok = make_tokenizer()
    model = make_model(len(tok))
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return Path(path)
