"""The policy: a Hugging Face causal LM and the per-token log-probs the loss needs.

Legend: B sequences, T positions, N selected positions, H hidden size, V vocabulary.

`token_logprobs` returns log_softmax(logits / T) at the next token, in float32 — what vLLM returns with
logprobs_mode="processed_logprobs" (logits upcast before the softmax, the temperature applied to them). It
computes logits only at the positions it is asked about (the completion), never the full [B, T, V] tensor,
and for large N x V it goes through the LM head in chunks whose float32 logits are recomputed in backward.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM, PreTrainedModel

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
# config attributes of architectures whose logits are not plain lm_head(hidden): they take the slow path
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
CHUNK_ELEMENTS = 1 << 27  # float32 logits elements (512 MiB) above which the head runs in checkpointed chunks


def load_model(path: str | Path, dtype: str = "float32", attn_implementation: str = "sdpa",
               gradient_checkpointing: bool = False) -> PreTrainedModel:
    """An AutoModelForCausalLM from a local directory, in training mode, without the KV cache."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ValueError(f"model.path {str(path)!r} is not a Hugging Face model directory (no config.json); "
                         "pass a local directory, e.g. --model.path /path/to/model")
    if dtype not in _DTYPES:
        raise ValueError(f"model dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    if attn_implementation not in ("sdpa", "eager"):
        raise ValueError(f"attn_implementation must be 'sdpa' or 'eager', got {attn_implementation!r}")
    model = AutoModelForCausalLM.from_pretrained(p, dtype=getattr(torch, _DTYPES[dtype]),
                                                 attn_implementation=attn_implementation)
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _plain_head(model) -> bool:
    cfg = model.config
    return all(not getattr(cfg, a, None) for a in _LOGIT_TRANSFORMS) and model.get_output_embeddings() is not None


def _head_logp(head, h_NH: torch.Tensor, targets_N: torch.Tensor, temperature: float, with_entropy: bool,
               entropy_grad: bool):
    """log p(target) and entropy of softmax(head(h) / T), upcast to float32."""
    logits = head(h_NH).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse_N = torch.logsumexp(logits, dim=-1)
    logp_N = logits.gather(-1, targets_N[:, None]).squeeze(-1) - lse_N
    ent_N = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            # H = lse - sum(p * z): one softmax, no log_softmax tensor kept
            ent_N = lse_N - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp_N, ent_N


def _chunked_head(head, h_NH, targets_N, temperature, with_entropy, entropy_grad, vocab):
    """The head in chunks; under grad each chunk is checkpointed so only one chunk's logits live at a time."""
    rows = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    outs_logp, outs_ent = [], []
    for s in range(0, h_NH.shape[0], rows):
        args = (head, h_NH[s: s + rows], targets_N[s: s + rows], temperature, with_entropy, entropy_grad)
        if torch.is_grad_enabled():
            lp, en = checkpoint(_head_logp, *args, use_reentrant=False)
        else:
            lp, en = _head_logp(*args)
        outs_logp.append(lp)
        outs_ent.append(en)
    ent = torch.cat(outs_ent) if with_entropy else None
    return torch.cat(outs_logp), ent


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, temperature: float,
                   mask_BT: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                   with_entropy: bool = True, entropy_grad: bool = False):
    """Per-position log-prob of the next token and the entropy of the next-token distribution.

    Returns (logp_BT, entropy_BT) float32, where logp_BT[b, t] = log softmax(logits[b, t] / T)[ids[b, t + 1]];
    the last column and every position outside `mask_BT` (when given) are 0. entropy_BT is None when
    `with_entropy` is False; it carries gradient only with `entropy_grad` (the entropy bonus).
    `attention_mask` may be None for right-padded batches: causal attention already keeps real tokens from
    seeing the padding after them, and SDPA then takes its fast causal path.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    B, T = input_ids.shape
    targets_BT = torch.zeros_like(input_ids)
    targets_BT[:, :-1] = input_ids[:, 1:]
    if mask_BT is None:
        mask_BT = torch.ones_like(input_ids, dtype=torch.bool)
        mask_BT[:, -1] = False
    else:
        mask_BT = mask_BT.bool()
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    if _plain_head(model):
        h_BTH = model.base_model(**kwargs).last_hidden_state
        head = model.get_output_embeddings()
    else:  # logits need the model's own transform: full logits, then the selection
        h_BTH = model(**kwargs).logits
        head = torch.nn.Identity()
    h_NH = h_BTH[mask_BT]
    targets_N = targets_BT[mask_BT]
    vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else \
        model.config.vocab_size
    if h_NH.shape[0] * vocab > CHUNK_ELEMENTS:
        logp_N, ent_N = _chunked_head(head, h_NH, targets_N, temperature, with_entropy, entropy_grad, vocab)
    else:
        logp_N, ent_N = _head_logp(head, h_NH, targets_N, temperature, with_entropy, entropy_grad)
    logp_BT = torch.zeros((B, T), dtype=torch.float32, device=input_ids.device).masked_scatter(mask_BT, logp_N)
    ent_BT = None
    if ent_N is not None:
        ent_BT = torch.zeros((B, T), dtype=torch.float32, device=input_ids.device).masked_scatter(mask_BT, ent_N)
    return logp_BT, ent_BT


class PolicyModule(torch.nn.Module):
    """An nn.Module whose forward returns (logp_BT, entropy_BT): what DDP and DeepSpeed wrap.

    DDP and the DeepSpeed engine only see gradients of computations that run through their own forward, so
    the selected-position head must live inside a module rather than being called on `model.base_model`.
    The HF model is the submodule `lm` (checkpoints and published weights strip that prefix).
    """

    def __init__(self, model: PreTrainedModel, temperature: float) -> None:
        super().__init__()
        self.lm = model
        self.temperature = temperature

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask_BT: torch.Tensor,
                with_entropy: bool = True, entropy_grad: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return token_logprobs(self.lm, input_ids, None, self.temperature, mask_BT=mask_BT,
                              position_ids=position_ids, with_entropy=with_entropy, entropy_grad=entropy_grad)
