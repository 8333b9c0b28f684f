"""RL of the block-diffusion policy: on-policy ratios are 1 (the replay reproduces the decode's
log-probs on the training path), the reward of a learnable task rises, dynamic sampling,
determinism, and two DDP processes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from accelerate import debug_launcher

from gr2model.models.block_diffusion import convert_to_block_diffusion
from gr2model.decoding.diffusion_decode import diffusion_generate
from gr2model.training.diffusion_rl import DiffusionRLConfig, train_diffusion_rl
from gr2model.task.tokenizer import special_ids

from tiny import equals_one_process, one_item_tokenizer, random_prompts, tiny_model, two_process_worker

BLOCK = 4


@pytest.fixture(scope="module")
def tok():
    return one_item_tokenizer()


def policy(tok, seed: int = 0):
    return convert_to_block_diffusion(tiny_model(tok, seed), tok, BLOCK)


def hits_reward(target: int):
    """The share of the first block's 4 tokens that are `target`: learnable, and graded."""

    def reward(i: int, completion: list[int]) -> tuple[float, dict[str, float]]:
        hits = sum(1 for t in completion[:4] if t == target) / 4
        return hits, {"hits": hits}

    return reward


def test_config_defaults() -> None:
    cfg = DiffusionRLConfig()
    assert cfg.group_size == 8 and cfg.clip_low == 0.2 and cfg.clip_high == 0.2
    with pytest.raises(ValueError):
        DiffusionRLConfig(old_logprobs="guess")
    with pytest.raises(ValueError):
        DiffusionRLConfig(group_size=1)  # DAPOConfig's checks apply


def test_train_diffusion_rl_raises_a_learnable_reward(tok) -> None:
    """Block 4, threshold 0.3. With one minibatch per step every ratio is taken before that
    step's update, so ratio = exp(replay - decode log-prob) must be 1 token by token:
    approx_kl (the mean of ratio - 1 - log ratio >= 0) is ~0. The reward rises and the
    policy gets confident enough to commit several tokens per forward.
    (Measured: reward 0.01 -> 0.94 over 30 steps, 1.0 -> 1.86 tokens per forward.)"""
    target = tok.convert_tokens_to_ids('"recommendations"')
    cfg = DiffusionRLConfig(group_size=8, prompts_per_step=4, steps=30, minibatch_size=32, lr=3e-3, max_new_tokens=4,
                            threshold=0.3)
    seen: list[dict[str, float]] = []
    result = train_diffusion_rl(policy(tok), tok, random_prompts(tok, 16, seed=4), hits_reward(target), cfg,
                                on_step=seen.append)
    assert seen == result.history and len(seen) == 30
    assert {"reward_mean", "kept_groups", "clip_fraction", "ratio_mean", "approx_kl", "hits", "tokens_per_forward",
            "canvases_per_rollout"} <= set(seen[0])
    for h in seen:
        if h["kept_groups"] > 0:
            assert h["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
            assert h["approx_kl"] < 1e-9 and h["clip_fraction"] == 0.0
        assert 1.0 <= h["canvases_per_rollout"] <= BLOCK or h["kept_groups"] == 0
    first = sum(h["reward_mean"] for h in seen[:5]) / 5
    last = sum(h["reward_mean"] for h in seen[-5:]) / 5
    assert first < 0.2 and last > 0.6, (first, last)
    assert seen[-1]["tokens_per_forward"] > seen[0]["tokens_per_forward"]
    # The trained policy's greedy decode starts with the rewarded token.
    sp = special_ids(tok)
    greedy = diffusion_generate(result.model, random_prompts(tok, 16, seed=4), pad_id=sp["pad"], eos_id=sp["eos"],
                                mask_id=sp["mask"], block_size=BLOCK, threshold=0.3, max_new_tokens=4)
    assert sum(s[0] == target for s in greedy.sequences) >= 12
    assert not result.model.training


def test_replay_old_logprobs_and_inner_epochs(tok) -> None:
    """old_logprobs="replay" takes the same first step as "decode" (same rollouts, ratios 1);
    a second pass over the rollouts sees ratios away from 1."""
    target = tok.convert_tokens_to_ids('"recommendations"')
    prompts = random_prompts(tok, 8, seed=5)
    base = DiffusionRLConfig(group_size=4, prompts_per_step=2, steps=2, minibatch_size=8, lr=1e-2, max_new_tokens=4,
                             threshold=0.3, seed=3)
    runs = {}
    for mode in ("decode", "replay"):
        run_cfg = replace(base, old_logprobs=mode)
        runs[mode] = train_diffusion_rl(policy(tok), tok, prompts, hits_reward(target), run_cfg)
    a, b = runs["decode"].history[0], runs["replay"].history[0]
    assert a["reward_mean"] == b["reward_mean"] and a["kept_groups"] == b["kept_groups"] > 0
    assert b["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and b["approx_kl"] < 1e-10
    two = train_diffusion_rl(policy(tok), tok, prompts, hits_reward(target), replace(base, inner_epochs=2))
    assert two.history[0]["approx_kl"] > 1e-6  # the second pass's ratios moved


def test_sub_block_rollouts_stay_on_policy(tok) -> None:
    """With sub_block_size the rollouts commit sub-block by sub-block, and the unchanged
    replay still reproduces their log-probs (ratios 1); a size that does not divide the
    block fails before anything is decoded."""
    target = tok.convert_tokens_to_ids('"recommendations"')
    cfg = DiffusionRLConfig(group_size=4, prompts_per_step=2, steps=2, minibatch_size=8, lr=1e-2, max_new_tokens=8,
                            threshold=0.3, seed=3, sub_block_size=2)
    result = train_diffusion_rl(policy(tok), tok, random_prompts(tok, 8, seed=5), hits_reward(target), cfg)
    h = result.history[0]
    assert h["kept_groups"] > 0
    assert h["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and h["approx_kl"] < 1e-9
    with pytest.raises(ValueError):
        DiffusionRLConfig(sub_block_size=0)
    with pytest.raises(ValueError, match="divide block_size 4"):
        train_diffusion_rl(policy(tok), tok, [[8, 9]], hits_reward(target), replace(cfg, sub_block_size=3))


def test_dynamic_sampling_drops_uninformative_groups(tok) -> None:
    model = policy(tok)
    before = [p.detach().clone() for p in model.parameters()]
    cfg = DiffusionRLConfig(group_size=4, prompts_per_step=3, steps=2, max_new_tokens=4, max_resample_rounds=2, lr=1e-2)
    result = train_diffusion_rl(model, tok, random_prompts(tok, 5, seed=6), lambda i, c: (1.0, {}), cfg)
    for h in result.history:
        assert h["kept_groups"] == 0 and h["resample_rounds"] == 2 and h["sampled_groups"] == 9
    assert all(torch.equal(a, b) for a, b in zip(before, result.model.parameters()))


def test_train_diffusion_rl_is_deterministic_and_checks_the_model(tok) -> None:
    prompts = random_prompts(tok, 6, seed=7)
    cfg = DiffusionRLConfig(group_size=4, prompts_per_step=2, steps=3, minibatch_size=4, inner_epochs=2, lr=1e-2,
                            max_new_tokens=6, threshold=0.2, seed=7)

    def reward(i: int, c: list[int]) -> tuple[float, dict[str, float]]:
        return float(len(c)) + 0.1 * c[0], {}

    def run():
        r = train_diffusion_rl(policy(tok), tok, prompts, reward, cfg)
        return [{k: v for k, v in h.items() if not k.endswith("_s")} for h in r.history], r.model

    h1, m1 = run()
    h2, m2 = run()
    assert h1 == h2 and any(h["kept_groups"] > 0 for h in h1)
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
    ar = tiny_model(tok)
    with pytest.raises(ValueError, match="block-diffusion"):
        train_diffusion_rl(ar, tok, prompts, reward, cfg)


def _rl_worker(tok, prompts: list[list[int]], target: int, cfg: DiffusionRLConfig, out: Path) -> None:
    """One of two processes (forked by debug_launcher): train, save the weights."""
    reward = hits_reward(target)
    two_process_worker(out, lambda acc: train_diffusion_rl(policy(tok), tok, prompts, reward, cfg, accelerator=acc))


def test_train_diffusion_rl_on_two_processes(tok, tmp_path: Path) -> None:
    """Two CPU processes under DDP: uneven kept groups and replay rows per process neither
    deadlock nor desynchronise the replicas, the run equals one process, and the reward rises."""
    target = tok.convert_tokens_to_ids('"recommendations"')
    cfg = DiffusionRLConfig(group_size=8, prompts_per_step=4, steps=12, minibatch_size=16, lr=3e-3, max_new_tokens=4,
                            threshold=0.3)
    prompts = random_prompts(tok, 16, seed=4)
    debug_launcher(_rl_worker, args=(tok, prompts, target, cfg, tmp_path), num_processes=2)
    history = equals_one_process(tmp_path, train_diffusion_rl(policy(tok), tok, prompts, hits_reward(target), cfg))
    assert len(history) == 12
    assert sum(h["reward_mean"] for h in history[-3:]) > sum(h["reward_mean"] for h in history[:3])


def test_micro_batches_take_the_same_step(tok) -> None:
    """Gradient accumulation over parts of a minibatch is the whole minibatch's step."""
    target = tok.convert_tokens_to_ids('"recommendations"')
    prompts = random_prompts(tok, 8, seed=8)
    cfg = DiffusionRLConfig(group_size=4, prompts_per_step=2, steps=2, minibatch_size=8, lr=1e-2, max_new_tokens=4,
                            threshold=0.3, micro_batch_columns=0)
    runs = [train_diffusion_rl(policy(tok), tok, prompts, hits_reward(target), replace(cfg, micro_batch_columns=m))
            for m in (0, 1, 60)]
    for other in runs[1:]:
        for a, b in zip(runs[0].history, other.history):
            assert a["reward_mean"] == b["reward_mean"]
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        pairs = zip(runs[0].model.parameters(), other.model.parameters())
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in pairs)
