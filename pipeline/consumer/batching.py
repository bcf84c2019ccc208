"""Groups -> padded tensors: mini-batches (optimizer steps) of micro-batches (forward/backward passes).

Legend: B sequences, T positions. A sequence is prompt (P tokens) + completion (C tokens), right-padded.
Position t predicts token t + 1, so completion token j (at P + j) is predicted at position P + j - 1:
`mask_BT`, `old_logp_BT` and the learner's `logp_BT` all live on those predicting positions.

Invariants:
- a mini-batch is a contiguous run of whole groups; `split_minibatches` covers every group exactly once;
- every rank builds the same plan from the same groups (deterministic, no communication), gets a disjoint
  share of the mini-batch's sequences, and runs the SAME number of micro-batches (ZeRO-2/3 and DDP issue
  collectives per backward; a rank short of sequences gets an empty micro-batch with no valid token);
- a micro-batch holds at most `micro_batch_tokens` padded tokens unless one sequence alone is longer;
- `num_tokens` of a mini-batch counts its valid tokens over all ranks: the token-mean denominator.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from pipeline import protocol as P

PAD_ID = 0  # any id works: with right padding and causal attention no real token ever attends to a pad


@dataclass
class Seq:
    """One sample flattened: its full token ids and where the completion starts."""

    ids: np.ndarray  # int64 [P + C]
    prompt_len: int
    logp: np.ndarray  # float32 [C] behaviour log-probs
    adv: float
    version: int


@dataclass
class MicroBatch:
    """Tensors of one forward/backward pass (CPU; the learner moves them to its device)."""

    input_ids_BT: torch.Tensor  # int64
    position_ids_BT: torch.Tensor  # int64
    mask_BT: torch.Tensor  # bool, predicting positions of completion tokens
    old_logp_BT: torch.Tensor  # float32, behaviour log-probs on the predicting positions
    adv_B: torch.Tensor  # float32
    version_B: torch.Tensor  # int64
    num_tokens: int  # valid tokens in this micro-batch
    prox_logp_BT: torch.Tensor | None = None  # decoupled PPO: filled by the learner before the update

    def to(self, device: torch.device) -> MicroBatch:
        """This micro-batch with the tensors the loss reads on `device` (itself when already there).

        `version_B` stays on the CPU (only statistics read it); `prox_logp_BT` is computed on the device.
        """
        if device.type == "cpu":
            return self
        return replace(self, input_ids_BT=self.input_ids_BT.to(device, non_blocking=True),
                       position_ids_BT=self.position_ids_BT.to(device, non_blocking=True),
                       mask_BT=self.mask_BT.to(device, non_blocking=True),
                       old_logp_BT=self.old_logp_BT.to(device, non_blocking=True),
                       adv_B=self.adv_B.to(device, non_blocking=True))


def flatten(groups: list[P.Group]) -> list[Seq]:
    """Every sample of every group as a Seq, in order."""
    seqs = []
    for gi, g in enumerate(groups):
        prompt = np.asarray(g.prompt_token_ids, dtype=np.int64)
        if prompt.size == 0:
            raise ValueError(f"group {gi} (prompt_id {g.prompt_id}) has an empty prompt: the first completion "
                             "token needs at least one token (e.g. BOS) to be predicted from")
        for s, a in zip(g.samples, g.advantages):
            ids = np.concatenate([prompt, np.asarray(s.token_ids, dtype=np.int64)])
            seqs.append(Seq(ids, prompt.size, np.asarray(s.logprobs, dtype=np.float32), float(a), int(s.version)))
    return seqs


def split_minibatches(groups: list[P.Group], num_mini: int) -> list[list[P.Group]]:
    """Contiguous runs of whole groups, as even as possible (fewer runs when there are fewer groups)."""
    if num_mini < 1:
        raise ValueError(f"num_mini must be >= 1, got {num_mini}")
    k = min(num_mini, len(groups))
    if k == 0:
        return []
    bounds = [round(i * len(groups) / k) for i in range(k + 1)]
    return [groups[bounds[i]: bounds[i + 1]] for i in range(k)]


def split_ranks(lengths: list[int], world_size: int) -> list[list[int]]:
    """Sequence indices per rank, balancing tokens (longest first onto the lightest rank)."""
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        shares[r].append(i)
        loads[r] += lengths[i]
    return shares


def pack_micro(lengths: list[int], indices: list[int], budget: int) -> list[list[int]]:
    """Indices into micro-batches of at most `budget` padded tokens; sorted by length so padding stays small."""
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    for i in order:
        # descending order: the first sequence of the current micro-batch is its longest
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def equalize(micro: list[list[int]], count: int) -> list[list[int]]:
    """Split the biggest micro-batches until there are `count`; pad with empty ones when nothing splits."""
    micro = [list(m) for m in micro]
    while len(micro) < count:
        j = max(range(len(micro)), key=lambda j: len(micro[j])) if micro else -1
        if j < 0 or len(micro[j]) < 2:
            micro.append([])
            continue
        half = len(micro[j]) // 2
        micro[j:j + 1] = [micro[j][:half], micro[j][half:]]
    return micro


def collate(seqs: list[Seq]) -> MicroBatch:
    """Right-padded tensors for `seqs` (an empty list gives one dummy row with no valid token)."""
    if not seqs:
        z = torch.zeros((1, 1), dtype=torch.long)
        return MicroBatch(z, z.clone(), torch.zeros((1, 1), dtype=torch.bool), torch.zeros((1, 1)),
                          torch.zeros(1), torch.zeros(1, dtype=torch.long), 0)
    width = max(s.ids.size for s in seqs)
    n = len(seqs)
    ids = np.full((n, width), PAD_ID, dtype=np.int64)
    mask = np.zeros((n, width), dtype=np.bool_)
    old = np.zeros((n, width), dtype=np.float32)
    for b, s in enumerate(seqs):
        ids[b, : s.ids.size] = s.ids
        c = s.logp.size
        mask[b, s.prompt_len - 1: s.prompt_len - 1 + c] = True
        old[b, s.prompt_len - 1: s.prompt_len - 1 + c] = s.logp
    pos = np.broadcast_to(np.arange(width, dtype=np.int64), (n, width)).copy()
    return MicroBatch(
        torch.from_numpy(ids), torch.from_numpy(pos), torch.from_numpy(mask), torch.from_numpy(old),
        torch.tensor([s.adv for s in seqs], dtype=torch.float32),
        torch.tensor([s.version for s in seqs], dtype=torch.long), int(mask.sum()),
    )


def plan_minibatch(groups: list[P.Group], rank: int, world_size: int, micro_batch_tokens: int
                   ) -> tuple[list[MicroBatch], int]:
    """This rank's micro-batches of one mini-batch, and the mini-batch's valid tokens over all ranks."""
    seqs = flatten(groups)
    lengths = [s.ids.size for s in seqs]
    shares = split_ranks(lengths, world_size)
    packed = [pack_micro(lengths, share, micro_batch_tokens) for share in shares]
    count = max(1, max(len(p) for p in packed))
    mine = equalize(packed[rank], count)
    total = sum(s.logp.size for s in seqs)
    return [collate([seqs[i] for i in m]) for m in mine], total


def batch_stats(groups: list[P.Group], learner_version: int) -> dict[str, Any]:
    """Data statistics of a batch: rewards, advantages, lengths, staleness (learner version - sample version)."""
    samples = [s for g in groups for s in g.samples]
    if not samples:
        return {"num_groups": len(groups), "num_samples": 0}
    rewards = np.array([s.reward for s in samples], dtype=np.float64)
    adv = np.array([a for g in groups for a in g.advantages], dtype=np.float64)
    lens = np.array([s.token_ids.size for s in samples], dtype=np.float64)
    stale = np.array([learner_version - s.version for s in samples], dtype=np.float64)
    return {
        "num_groups": len(groups),
        "num_samples": len(samples),
        "reward_mean": float(rewards.mean()),
        "adv_mean": float(adv.mean()),
        "adv_abs_mean": float(np.abs(adv).mean()),
        "zero_adv_frac": float((adv == 0).mean()),
        "completion_len_mean": float(lens.mean()),
        "completion_len_max": float(lens.max()),
        "prompt_len_mean": float(np.mean([g.prompt_token_ids.size for g in groups])),
        "truncated_frac": float(np.mean([s.finish_reason == "length" for s in samples])),
        "staleness_mean": float(stale.mean()),
        "staleness_max": float(stale.max()),
        "stale_frac": float((stale > 0).mean()),
        "resolved_frac": float(np.mean([g.resolved for g in groups])),
        # groups holding both a right and a wrong answer (Reinforce-Ada-balance's goal; GRPO's are often not)
        "mixed_frac": float(np.mean([len({s.reward for s in g.samples}) > 1 for g in groups])),
        "group_size_min": min(len(g.samples) for g in groups),
        "group_size_max": max(len(g.samples) for g in groups),
        "pool_size_mean": float(np.mean([g.pool_size for g in groups])),
        "num_rounds_mean": float(np.mean([g.num_rounds for g in groups])),
    }
