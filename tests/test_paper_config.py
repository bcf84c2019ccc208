"""configs/qwen2.5-math-1.5b.toml runs the paper's algorithm, and the asynchronous config says where it departs.

The paper's values are written out below, one row per setting with where each comes from, so that a changed default
or an edited file that moves the "paper" config away from the paper fails here instead of changing the algorithm
silently (as the unset `sampling.exit_check` once did: it loaded as "prefix"). Sources:
  [paper]  Xiong et al., "Reinforce-Ada", arXiv 2510.04996: Algorithm 1, section 2.3 (advantages and loss),
           section 3 "RL Training Details";
  [script] the reference run, RLHFlow/Reinforce-Ada scripts/run_reinforce_ada.sh;
  [code]   the reference sampler, RLHFlow/Reinforce-Ada verl/trainer/ppo/ray_trainer.py
           `_generate_multi_round_adaptive_downsampling`, and verl/trainer/config/ppo_trainer.yaml.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest
import torch

from pipeline.buffer.sampler import AdaptiveSampler, Rollout
from pipeline.config import load_config

CONFIGS = Path(__file__).parents[1] / "configs"
PAPER_FILE = CONFIGS / "qwen2.5-math-1.5b.toml"
ASYNC_FILE = CONFIGS / "qwen2.5-math-1.5b-async.toml"

PAPER = [
    # --- adaptive sampling (Algorithm 1)
    ("sampling.round_size", 8),  # [code] round_repeat = 8 (ppo_trainer.yaml); [paper] sec. 3: "up to 32 responses"
    ("sampling.max_rounds", 4),  # [code] max_rounds = 4 (ppo_trainer.yaml); 8 x 4 = the paper's 32
    ("sampling.group_size", 4),  # [paper] sec. 3: "group size is set to be n = 4"; [script] n=4
    ("sampling.exit_rule", "balance"),  # [paper] Table 1: Reinforce-Ada-balance; [script] reinforce_ada_choice
    ("sampling.exit_check", "round"),  # [paper] Alg. 1 line 8 / sec. 2.2: "At the end of each round, we evaluate"
    ("sampling.allocation", "uniform"),  # [paper] Alg. 1 line 6: M responses per active prompt; footnote 2: the
    #                                    proportional-allocation variant "did not yield clear performance gains"
    ("sampling.positive_threshold", 0.5),  # [code] reward > positive_threshold (0.7 there): math-verify rewards are
    #                                        0/1, so any threshold in [0, 1) splits them the same
    ("sampling.temperature", 1.0),  # [script] temperature=1.0
    ("sampling.top_p", 1.0),  # [script] top_p=1.0
    ("sampling.max_new_tokens", 2048),  # [script] max_response_length=2048
    # --- groups and advantages (Algorithm 1 lines 15-19, section 2.3)
    ("buffer.max_staleness", 0),  # [paper] Alg. 1 is one synchronous iteration: sampled by the current policy
    ("buffer.unresolved", "keep"),  # [code] prompts still active after N rounds fall back to a group of their
    #                                 samples and are trained (zero advantage when all rewards are equal)
    ("buffer.downsample", "first"),  # [code] pos_cache[uid][:target_pos] and neg_cache[uid][:target_neg]
    ("buffer.normalize_std", False),  # [paper] sec. 2.3: "we remove the standard deviation term", A = r - mean;
    #                                   [script] norm_adv_by_std_in_grpo=False, global_stat_est=True
    # --- loss and optimizer (section 2.3, eq. 3; section 3)
    ("learner.lr", 1e-6),  # [paper] sec. 3: "AdamW optimizer with a fixed learning rate of 1e-6"
    ("learner.warmup_steps", 40),  # [paper] sec. 3: "10-step warm-up"; [script] lr_warmup_steps=10, stepped once per
    #                                training step = 4 optimizer steps here (mini_batches)
    ("learner.weight_decay", 0.0),  # [script] optim.weight_decay=0.
    ("learner.clip_low", 0.2),  # [paper] sec. 3: "clipping range to [0.2, 0.28]"; [script] clip_ratio_low=0.2
    ("learner.clip_high", 0.28),  # [paper] sec. 3; [script] clip_ratio_high=0.28
    ("learner.dual_clip", 10.0),  # [script] clip_ratio_c=10.0
    ("learner.entropy_coef", 1e-4),  # [paper] sec. 3: "entropy regularization term with coefficient 1e-4" (the
    #                                  script passes entropy_coeff=0; the config follows the paper's text)
    ("learner.tis_cap", 0.0),  # [paper] eq. 3 clips the token ratio; trajectory-level IS is "left for future work"
    ("learner.decoupled", False),  # [paper] eq. 3: the ratio is against pi_old, the policy that sampled
    ("learner.batch_prompts", 512),  # [paper] sec. 3: "prompt batch size of 512"; [script] train_prompt_bsz=512
    ("learner.mini_batches", 4),  # [script] train_prompt_mini_bsz=128: 512 / 128 updates per step
    ("learner.grad_clip", 1.0),  # [script] grad_clip=1.0
    ("learner.num_steps", 600),  # [paper] sec. 3: "Each RL run is carried out for 600 training steps"
    ("learner.gradient_checkpointing", True),  # [script] enable_gradient_checkpointing=True
    # --- task
    ("reward.fn", "pipeline.rewards.math:verify"),  # [paper] sec. 3: "Math-Verify ... serves as our verifier"
]


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict) and key != "extra":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _resolved(path: Path) -> dict:
    return _flat(msgspec.to_builtins(load_config(path)))


@pytest.mark.parametrize("key, value", PAPER, ids=[k for k, _ in PAPER])
def test_the_paper_config_holds_the_papers_value(key, value):
    got = _resolved(PAPER_FILE)[key]
    assert got == value and type(got) is type(value), f"{key} = {got!r}, the paper's setting is {value!r}"


def test_the_paper_config_sets_each_paper_value_in_the_file():
    """Each row is written in the file, not left to a default that a later change could move."""
    text = PAPER_FILE.read_text()
    sections = {}
    current = ""
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if m := re.fullmatch(r"\[([\w.]+)\]", line):
            current = m.group(1)
        elif "=" in line and current:
            sections.setdefault(current, set()).add(line.split("=", 1)[0].strip())
    unset = [k for k, _ in PAPER if k.rsplit(".", 1)[1] not in sections.get(k.rsplit(".", 1)[0], set())]
    assert not unset, f"set these in {PAPER_FILE.name}: {unset}"


def test_the_paper_config_trains_on_all_eight_gpus():
    cfg = load_config(PAPER_FILE)  # [paper] Table 2: 8 x H100 (the split is the one stated difference)
    assert cfg.learner.num_ranks + cfg.producers.count == 8


def test_every_difference_of_the_async_config_is_named_in_its_comments():
    paper, streaming = _resolved(PAPER_FILE), _resolved(ASYNC_FILE)
    assert paper.keys() == streaming.keys()
    differences = sorted(k for k in paper if paper[k] != streaming[k])
    comments = "\n".join(line.split("#", 1)[1] for line in ASYNC_FILE.read_text().splitlines() if "#" in line)
    unnamed = [k for k in differences if not re.search(rf"(?<![\w.]){re.escape(k)}(?![\w])", comments)]
    assert not unnamed, f"{ASYNC_FILE.name} differs from the paper in {unnamed} without saying so in its comments"
    assert "sampling.exit_check" in differences  # the difference this test was written for


# ---------------------------------------------------------------- the paper config, run


def _scripted(rounds: dict[int, list[list[float]]]):
    """generate(): prompt i's k-th round returns rounds[i][k] as rewards; the prompt's index is its token id."""
    issued: dict[int, int] = {}

    def generate(texts, nums):
        out = []
        for text, n in zip(texts, nums):
            i = int(text)
            rewards = rounds[i][issued.get(i, 0)]
            issued[i] = issued.get(i, 0) + 1
            assert n == len(rewards), (i, n)
            out.append([Rollout([7, 8], [-0.5, -0.5], r, [i]) for r in rewards])
        return out
    return generate


def test_the_paper_config_samples_whole_rounds_and_takes_the_whole_pool_mean():
    """Algorithm 1 under the paper config's sampling and buffer sections: the exit rule is checked after each
    round of M = 8, the pool is every sample of every round, advantages are r - mean(pool), the first samples of
    each class are kept, and an unresolved prompt is still trained with zero advantage."""
    cfg = load_config(PAPER_FILE)
    rounds = {
        # 6 right, 2 wrong in round 1: exits after it with a pool of 8 (mean 0.75). Checked sample by sample it
        # would exit after 4 samples with mean 0.5.
        0: [[1, 0, 1, 0, 1, 1, 1, 1]],
        # one right answer per round: the second right one arrives in round 2, pool 16, mean 2/16
        1: [[0, 0, 0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0, 1, 0]],
        # never right in 4 rounds: unresolved, kept as a zero-advantage group
        2: [[0.0] * 8] * 4,
    }
    sampler = AdaptiveSampler([(str(i), "1") for i in rounds], batch_size=3, sampling=cfg.sampling,
                              buffer=cfg.buffer)
    groups = {int(g.prompt_token_ids[0]): g for g in sampler.sample(_scripted(rounds))}
    assert sorted(groups) == [0, 1, 2]
    expected = {  # (kept rewards, advantages, pool size, rounds, resolved)
        0: ([1, 1, 0, 0], [0.25, 0.25, -0.75, -0.75], 8, 1, True),
        1: ([1, 1, 0, 0], [0.875, 0.875, -0.125, -0.125], 16, 2, True),
        2: ([0, 0, 0, 0], [0.0, 0.0, 0.0, 0.0], 32, 4, False),
    }
    for i, (rewards, advantages, pool, num_rounds, resolved) in expected.items():
        g = groups[i]
        got = sorted(zip([s.reward for s in g.samples], g.advantages), reverse=True)
        assert got == list(zip(map(float, rewards), advantages)), i
        assert (g.pool_size, g.num_rounds, g.resolved) == (pool, num_rounds, resolved), i


def test_the_paper_loss_is_a_token_mean():
    """[paper] sec. 2.3: "averaging over all valid tokens across the batch so that all tokens share the same
    weight regardless of their sequence length". At ratio 1 the loss is -sum_i(A_i * |a_i|) / sum_i |a_i|."""
    from pipeline.consumer.loss import LossConfig, ppo_loss

    cfg = load_config(PAPER_FILE)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    logp = torch.full((2, 6), -1.0)
    adv = torch.tensor([1.0, -1.0])
    loss, _ = ppo_loss(logp, logp.clone(), adv, mask, LossConfig.from_learner(cfg.learner))
    assert loss.item() == pytest.approx(-(1.0 * 6 - 1.0 * 2) / 8)  # a mean of sequence means would be 0
