"""The policy-gradient loss: token-level PPO clip with dual clip, token-mean aggregation, optional entropy
bonus and the decoupled (AReaL) behaviour importance weight.

Legend: B sequences, T positions, N valid (completion) tokens. Every [B, T] tensor is aligned to the
positions that *predict* a completion token (see batching.py), and `mask_BT` marks those positions.

The exact per-token loss (verl `compute_policy_loss` "vanilla" with dual clip, AReaL `ppo_actor_loss_fn`):

    rho   = exp(clamp(logp - anchor, -20, 20))   anchor = behaviour logp, or the proximal logp when decoupled
    pg1   = -A * rho
    pg2   = -A * clip(rho, 1 - clip_low, 1 + clip_high)
    L     = max(pg1, pg2)                                       (the PPO pessimistic bound)
    L     = min(L, c * |A|)   only where A < 0 and c > 0        (dual clip: caps the loss of a token whose
                                                                 ratio ran far above 1 under a negative
                                                                 advantage; for A >= 0 it never binds)
    L     = w * L             w = exp(clamp(prox - behaviour, -20, 20)), truncated to min(w, tis_cap) when
                              tis_cap > 0 (decoupled only; w is a constant, no gradient flows through it)
    loss  = sum(L * mask) / num_tokens  -  entropy_coef * sum(H * mask) / num_tokens

The clamp of the exponents (verl's, LOG_RATIO_CLAMP) binds only where a policy moved absurdly far from the one
that sampled (|log ratio| > 20: rho > 4.9e8): without it exp overflows float32 to inf, and inf times a zero
advantage, or a zero gradient, is NaN. Where it binds no gradient flows through rho: above e^20 the clip (A > 0)
or the dual clip (A < 0) takes it away already, below e^-20 it was under 1e-8. In normal steps the clamp changes
nothing, bit for bit.

`num_tokens` is the number of valid tokens of the whole (global) mini-batch, so splitting a mini-batch into
micro-batches or over ranks and summing the pieces gives exactly the loss of one big batch.

Truncation vs AReaL: AReaL *masks* tokens whose behaviour weight exceeds the cap (weight 0); we *truncate*
the weight to the cap (verl's TIS, Yao et al. 2025), which keeps the token's gradient direction with a bounded
scale. Without `decoupled` the anchor is the behaviour policy itself, w = 1, and `tis_cap` has no effect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pipeline.config import LearnerConfig

LOG_RATIO_CLAMP = 20.0  # bound on |log ratio| before exp, as verl (not a config field yet: see LossConfig)

# keys of the per-call stats; sums so that micro-batches and ranks can be added up before dividing
STAT_SUMS = ("num_tokens", "clip_sum", "dual_clip_sum", "ratio_sum", "kl_sum", "entropy_sum", "weight_sum",
             "loss_sum")


@dataclass(frozen=True)
class LossConfig:
    """The objective's settings (see the module docstring for the formula they enter)."""

    clip_low: float  # the ratio is clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float
    dual_clip: float = 0.0  # the bound c (> 1) on the loss of negative-advantage tokens, 0 = off
    tis_cap: float = 0.0  # truncation of the decoupled behaviour weight, 0 = off
    entropy_coef: float = 0.0  # entropy bonus (maximised) when the entropy is given
    log_ratio_clamp: float = LOG_RATIO_CLAMP  # |exponent| bound of rho and of the decoupled weight

    @classmethod
    def from_learner(cls, lc: LearnerConfig) -> LossConfig:
        """The loss settings of a learner config."""
        return cls(clip_low=lc.clip_low, clip_high=lc.clip_high, dual_clip=lc.dual_clip, tis_cap=lc.tis_cap,
                   entropy_coef=lc.entropy_coef)


def ppo_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv: torch.Tensor,
    mask_BT: torch.Tensor,
    cfg: LossConfig,
    *,
    entropy_BT: torch.Tensor | None = None,
    num_tokens: float | int | torch.Tensor | None = None,
    prox_logp_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level PPO-clip loss of one (micro-)batch and its summed statistics.

    logp_BT: log pi_theta(token) under the weights being trained (requires grad).
    old_logp_BT: the behaviour log-probs the engine returned.
    adv: per-sequence advantages [B] (broadcast over tokens) or per-token [B, T].
    mask_BT: 1/True where the position predicts a completion token; padding and prompt are 0.
    cfg: clip range, dual clip, TIS cap and entropy coefficient.
    entropy_BT: per-token entropy; the bonus applies when it is given and cfg.entropy_coef is not 0.
    num_tokens: token-mean denominator (the global mini-batch count); None = the valid tokens of this call.
    prox_logp_BT: proximal log-probs (decoupled PPO); None = clip against the behaviour policy.

    Returns (loss, stats): stats hold detached sums over valid tokens (`STAT_SUMS`) plus `ratio_max`;
    turn them into means with `finalize_stats` after adding up micro-batches and ranks.
    """
    if logp_BT.shape != old_logp_BT.shape or logp_BT.shape != mask_BT.shape:
        raise ValueError(f"logp {tuple(logp_BT.shape)}, old_logp {tuple(old_logp_BT.shape)} and mask "
                         f"{tuple(mask_BT.shape)} must have the same shape")
    if prox_logp_BT is not None and prox_logp_BT.shape != logp_BT.shape:
        raise ValueError(f"prox_logp {tuple(prox_logp_BT.shape)} must have the shape of logp {tuple(logp_BT.shape)}")
    if adv.dim() == 1 and logp_BT.dim() == 2 and adv.shape[0] == logp_BT.shape[0]:
        adv_BT = adv[:, None]
    elif adv.shape == logp_BT.shape:
        adv_BT = adv
    else:
        raise ValueError(f"advantages must have shape [B] or [B, T]; got {tuple(adv.shape)} for logp "
                         f"{tuple(logp_BT.shape)}")
    mask = mask_BT.to(logp_BT.dtype)
    valid = mask_BT.bool()
    count = mask.sum()
    denom = count.clamp(min=1.0) if num_tokens is None else num_tokens
    adv_BT = adv_BT.to(logp_BT.dtype)
    old = old_logp_BT.to(logp_BT.dtype)

    anchor = old if prox_logp_BT is None else prox_logp_BT.to(logp_BT.dtype).detach()
    # masked positions may hold anything (padding); zero the exponent there so no inf/nan leaks into grads
    log_ratio = torch.where(valid, logp_BT - anchor, torch.zeros_like(logp_BT))
    ratio = torch.exp(log_ratio.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp))
    pg1 = -adv_BT * ratio
    pg2 = -adv_BT * torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    per_token = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    dual = torch.zeros_like(valid)
    if cfg.dual_clip > 0:
        bound = -adv_BT * cfg.dual_clip  # = c * |A| where A < 0
        dual = (adv_BT < 0) & (per_token > bound)
        per_token = torch.where(adv_BT < 0, torch.minimum(per_token, bound), per_token)

    if prox_logp_BT is not None:
        log_weight = torch.where(valid, anchor - old, torch.zeros_like(anchor))
        weight = torch.exp(log_weight.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp))
        if cfg.tis_cap > 0:
            weight = torch.clamp(weight, max=cfg.tis_cap)
        per_token = per_token * weight.detach()
    else:
        weight = torch.ones_like(ratio)

    loss = (per_token * mask).sum() / denom
    if entropy_BT is not None and cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * (entropy_BT * mask).sum() / denom

    with torch.no_grad():
        log_ratio_b = torch.where(valid, logp_BT - old, torch.zeros_like(logp_BT))  # vs behaviour
        log_ratio_b = log_ratio_b.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
        kl_k3 = torch.exp(log_ratio_b) - 1.0 - log_ratio_b  # KL(behaviour || pi_theta), samples ~ behaviour
        stats = {
            "num_tokens": count.detach(),
            "clip_sum": (clipped.to(mask.dtype) * mask).sum(),
            "dual_clip_sum": (dual.to(mask.dtype) * mask).sum(),
            "ratio_sum": (ratio * mask).sum(),
            "ratio_max": torch.where(valid, ratio, torch.zeros_like(ratio)).max() if ratio.numel() else
            ratio.new_zeros(()),
            "kl_sum": (kl_k3 * mask).sum(),
            "entropy_sum": (entropy_BT * mask).sum() if entropy_BT is not None else mask.new_zeros(()),
            "weight_sum": (weight * mask).sum(),
            "loss_sum": (per_token * mask).sum(),
        }
        stats = {k: v.detach().float() for k, v in stats.items()}
    return loss, stats


def add_stats(total: dict[str, torch.Tensor] | None, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Accumulate micro-batch stats (sums add, `ratio_max` takes the max). Stays on device: no sync."""
    if total is None:
        return dict(stats)
    out = {k: total[k] + stats[k] for k in STAT_SUMS}
    out["ratio_max"] = torch.maximum(total["ratio_max"], stats["ratio_max"])
    return out


def finalize_stats(total: dict[str, torch.Tensor]) -> dict[str, float]:
    """Means per valid token: clip_frac, dual_clip_frac, ratio_mean, ratio_max, kl_behaviour (k3), entropy,
    behaviour_weight (decoupled), pg_loss (token-mean policy loss without the entropy bonus)."""
    n = max(float(total["num_tokens"]), 1.0)
    return {
        "clip_frac": float(total["clip_sum"]) / n,
        "dual_clip_frac": float(total["dual_clip_sum"]) / n,
        "ratio_mean": float(total["ratio_sum"]) / n,
        "ratio_max": float(total["ratio_max"]),
        "kl_behaviour": float(total["kl_sum"]) / n,
        "entropy": float(total["entropy_sum"]) / n,
        "behaviour_weight": float(total["weight_sum"]) / n,
        "pg_loss": float(total["loss_sum"]) / n,
        "num_tokens": float(total["num_tokens"]),
    }
