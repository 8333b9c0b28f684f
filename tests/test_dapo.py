"""DAPO: group advantages, the clipped token-level loss, log-prob parity with the decoder, and a policy that learns."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from accelerate import debug_launcher

from gr2model.decoding.ar_decode import ar_generate
from gr2model.training.dapo import DAPOConfig, dapo_loss, group_advantages, sequence_logprobs, train_dapo
from gr2model.task.tokenizer import special_ids

from tiny import equals_one_process, one_item_tokenizer, random_prompts, tiny_model, two_process_worker


@pytest.fixture(scope="module")
def tok():
    return one_item_tokenizer()


# -------------------------------------------------------------- advantages


def test_group_advantages() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.1, 0.1, 0.1, 0.1], [-1.0, 0.2, 3.0, 0.2]])
    adv, keep = group_advantages(rewards)
    assert keep.tolist() == [True, False, False, True]
    assert torch.all(adv[~keep] == 0.0)  # exactly 0, even for 0.1 whose float mean is not 0.1
    assert torch.allclose(adv[keep].mean(dim=1), torch.zeros(2), atol=1e-6)
    assert torch.allclose(adv[keep].std(dim=1), torch.ones(2), atol=1e-4)
    # Order within a group is kept: the best completion gets the largest advantage.
    assert adv[3].argmax() == 2 and adv[3].argmin() == 0
    # Shifting or scaling a group's rewards does not change its advantages.
    adv2, _ = group_advantages(3.0 * rewards + 7.0)
    assert torch.allclose(adv2, adv, atol=1e-4)


# -------------------------------------------------------------------- loss


def test_dapo_loss_zero_when_nothing_to_learn() -> None:
    logp = torch.log(torch.rand(3, 5, generator=torch.Generator().manual_seed(0))).requires_grad_(True)
    loss, stats = dapo_loss(logp, logp.detach().clone(), torch.zeros(3), torch.ones(3, 5), 0.2, 0.28)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(logp.grad) == 0
    assert stats["ratio_mean"] == pytest.approx(1.0) and stats["clip_fraction"] == 0.0


def test_dapo_loss_at_ratio_one_is_minus_mean_advantage() -> None:
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(4, 6, generator=g)
    adv = torch.randn(4, generator=g)
    loss, _ = dapo_loss(logp, logp.clone(), adv, torch.ones(4, 6), 0.2, 0.28)
    assert loss.item() == pytest.approx(-adv.mean().item(), abs=1e-6)
    # The gradient is the policy gradient: -A / n_tokens on every token's log-prob.
    x = logp.clone().requires_grad_(True)
    dapo_loss(x, logp, adv, torch.ones(4, 6), 0.2, 0.28)[0].backward()
    assert torch.allclose(x.grad, (-adv / 24.0)[:, None].expand(4, 6), atol=1e-7)


def test_dapo_loss_clips_the_right_side() -> None:
    old = torch.full((1, 1), math.log(0.1))

    def grad_at(ratio: float, adv: float) -> float:
        x = (old + math.log(ratio)).requires_grad_(True)
        loss, _ = dapo_loss(x, old, torch.tensor([adv]), torch.ones(1, 1), 0.2, 0.28)
        loss.backward()
        return float(x.grad)

    assert grad_at(1.5, +1.0) == 0.0  # above 1 + clip_high with A > 0: clipped
    assert grad_at(1.2, +1.0) != 0.0  # inside [1 - 0.2, 1 + 0.28]: not clipped (clip-higher)
    assert grad_at(0.5, -1.0) == 0.0  # below 1 - clip_low with A < 0: clipped
    assert grad_at(1.5, -1.0) != 0.0  # a step the wrong way is never clipped away
    assert grad_at(0.5, +1.0) != 0.0
    _, stats = dapo_loss(old + math.log(1.5), old, torch.tensor([1.0]), torch.ones(1, 1), 0.2, 0.28)
    assert stats["clip_fraction"] == 1.0 and stats["ratio_mean"] == pytest.approx(1.5)


def test_dapo_loss_averages_over_tokens() -> None:
    logp = torch.zeros(2, 9)
    mask = torch.zeros(2, 9)
    mask[0, :1] = 1.0  # a 1-token sequence with A = +1
    mask[1, :] = 1.0  # a 9-token sequence with A = -1
    logp[0, 1:] = float("-inf")  # padding may hold anything
    loss, stats = dapo_loss(logp, logp.clone(), torch.tensor([1.0, -1.0]), mask, 0.2, 0.28)
    # Token-level: (1 * -1 + 9 * +1) / 10 = 0.8; a per-sequence mean would give 0.
    assert loss.item() == pytest.approx(0.8)
    assert stats["tokens"] == 10.0


# -------------------------------------------------------------- log-probs


def test_sequence_logprobs_match_the_decoder(tok) -> None:
    model = tiny_model(tok, scale=0.3)
    sp = special_ids(tok)
    prompts = random_prompts(tok, 6, seed=3)

    def sample(eos: int):
        return ar_generate(
            model, prompts, pad_id=sp["pad"], eos_id=eos, max_new_tokens=8, temperature=1.0,
            generator=torch.Generator().manual_seed(0), return_logprobs=True,
        )

    # The random model seldom writes <|eos|>; stopping at its most frequent
    # token instead gives ragged completions, as real rollouts are.
    free = [t for s in sample(-1).sequences for t in s]
    out = sample(max(set(free), key=free.count))
    lengths = [len(s) for s in out.sequences]
    assert len(set(lengths)) > 1
    with torch.no_grad():
        logp, mask = sequence_logprobs(model, prompts, out.sequences, sp["pad"])
    assert logp.shape == mask.shape == (6, max(lengths))
    for row, (seq_lp, n) in enumerate(zip(out.logprobs, lengths)):
        assert mask[row].tolist() == [1.0] * n + [0.0] * (max(lengths) - n)
        assert torch.allclose(logp[row, :n], torch.tensor(seq_lp), atol=1e-4)
    # Gradients flow when asked for.
    lp, _ = sequence_logprobs(model, prompts, out.sequences, sp["pad"])
    lp.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# ------------------------------------------------------------------ train


def test_train_dapo_raises_a_learnable_reward(tok) -> None:
    target = tok.convert_tokens_to_ids('"recommendations"')
    prompts = random_prompts(tok, 16, seed=4)

    def reward(i: int, completion: list[int]) -> tuple[float, dict[str, float]]:
        hit = float(completion[0] == target)
        return hit, {"hit": hit}

    cfg = DAPOConfig(group_size=8, prompts_per_step=4, steps=30, minibatch_size=16, lr=3e-3, max_new_tokens=3, seed=0)
    seen: list[dict[str, float]] = []
    result = train_dapo(tiny_model(tok), tok, prompts, reward, cfg, on_step=seen.append)
    assert seen == result.history and len(seen) == 30
    assert {"reward_mean", "kept_groups", "clip_fraction", "response_length", "hit", "resample_rounds"} <= set(seen[0])
    first = sum(h["reward_mean"] for h in seen[:5]) / 5
    last = sum(h["reward_mean"] for h in seen[-5:]) / 5
    assert first < 0.2 and last > 0.6, (first, last)
    assert seen[-1]["hit"] == seen[-1]["reward_mean"]
    # The trained policy's greedy answer starts with the rewarded token.
    sp = special_ids(tok)
    greedy = ar_generate(result.model, prompts, pad_id=sp["pad"], eos_id=sp["eos"], max_new_tokens=1)
    assert sum(s[0] == target for s in greedy.sequences) >= 12


def test_dynamic_sampling_drops_uninformative_groups(tok) -> None:
    """A constant reward gives no group any signal: every round is resampled, no update is made."""
    model = tiny_model(tok)
    before = [p.detach().clone() for p in model.parameters()]
    cfg = DAPOConfig(group_size=4, prompts_per_step=3, steps=2, max_new_tokens=2, max_resample_rounds=2, lr=1e-2)
    result = train_dapo(model, tok, random_prompts(tok, 5, seed=5), lambda i, c: (1.0, {}), cfg)
    for h in result.history:
        assert h["kept_groups"] == 0 and h["resample_rounds"] == 2 and h["sampled_groups"] == 9
        assert h["reward_mean"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, result.model.parameters()))


def test_train_dapo_is_deterministic(tok) -> None:
    prompts = random_prompts(tok, 6, seed=6)
    cfg = DAPOConfig(group_size=4, prompts_per_step=2, steps=3, minibatch_size=4, inner_epochs=2, lr=1e-2,
                     max_new_tokens=4, seed=7)

    def reward(i: int, c: list[int]) -> tuple[float, dict[str, float]]:
        return float(len(c)) + 0.1 * c[0], {}

    def run():
        r = train_dapo(tiny_model(tok), tok, prompts, reward, cfg)
        return [{k: v for k, v in h.items() if not k.endswith("_s")} for h in r.history], r.model

    h1, m1 = run()
    h2, m2 = run()
    assert h1 == h2
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
    assert any(h["kept_groups"] > 0 for h in h1)


def _first_token_reward(target: int):
    def reward(i: int, completion: list[int]) -> tuple[float, dict[str, float]]:
        return float(completion[0] == target), {}

    return reward


def _dapo_worker(tok, prompts: list[list[int]], target: int, cfg: DAPOConfig, out: Path) -> None:
    """One of two processes (forked by debug_launcher): train, save the weights."""
    reward = _first_token_reward(target)
    two_process_worker(out, lambda acc: train_dapo(tiny_model(tok), tok, prompts, reward, cfg, accelerator=acc))


def test_train_dapo_on_two_processes(tok, tmp_path: Path) -> None:
    """Two CPU processes under DDP: uneven kept groups per process (dynamic
    sampling) neither deadlock nor desynchronise the replicas, the run equals one
    process (the same rollouts from per-row streams, the same minibatches from the
    shared shuffle), and the reward rises."""
    target = tok.convert_tokens_to_ids('"recommendations"')
    cfg = DAPOConfig(group_size=8, prompts_per_step=4, steps=12, minibatch_size=16, lr=3e-3, max_new_tokens=3)
    prompts = random_prompts(tok, 16, seed=4)
    debug_launcher(_dapo_worker, args=(tok, prompts, target, cfg, tmp_path), num_processes=2)
    history = equals_one_process(tmp_path, train_dapo(tiny_model(tok), tok, prompts, _first_token_reward(target), cfg))
    assert len(history) == 12
    assert all(h["kept_groups"] <= 4 for h in history)
    assert sum(h["reward_mean"] for h in history[-3:]) > sum(h["reward_mean"] for h in history[:3])
