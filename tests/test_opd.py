"""On-policy distillation: the KL losses (zero when equal, non-negative, their gradients,
forward vs reverse, top-k with a rest bucket), the teacher's alignment with the student's
replay (zero loss when the models agree), and a student that moves toward its teacher."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from accelerate import debug_launcher
from torch.distributions import Categorical, kl_divergence

from gr2model.models.block_diffusion import convert_to_block_diffusion
from gr2model.training.dapo import sequence_logprobs
from gr2model.training.opd import (
    OPDConfig,
    OPDResult,
    opd_loss,
    teacher_targets,
    teacher_topk,
    token_kl,
    topk_token_kl,
    train_opd,
)

from gr2model.training.cft import CFTAnchor, CFTConfig, encode_cft_example
from tiny import (
    equals_one_process, one_item_tokenizer, random_prompts, tiny_model, toy_examples, toy_items, toy_model, toy_tokenizer,
    two_process_worker,
)  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    return one_item_tokenizer()


def logits_pair(seed: int, shape=(3, 5, 11), scale: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(shape, generator=g), scale * torch.randn(shape, generator=g)


# ------------------------------------------------------------------ losses


@pytest.mark.parametrize("kind", ["forward", "reverse"])
@pytest.mark.parametrize("top_k", [0, 1, 4, 11])
def test_zero_when_student_equals_teacher(kind, top_k) -> None:
    s, _ = logits_pair(0)
    student = s.clone().requires_grad_(True)
    # The teacher's logits may differ by a constant per token (same softmax).
    loss = opd_loss(student, s + 5.0, torch.ones(3, 5), kind=kind, top_k=top_k)
    loss.backward()
    assert abs(loss.item()) < 1e-6
    assert student.grad.abs().max().item() < 1e-6


@pytest.mark.parametrize("kind", ["forward", "reverse"])
def test_kl_is_nonnegative_and_matches_the_definition(kind) -> None:
    for seed in range(5):
        s, t = logits_pair(seed)
        kl = token_kl(s, t, kind)
        ref = kl_divergence(Categorical(logits=t), Categorical(logits=s)) if kind == "forward" else (
            kl_divergence(Categorical(logits=s), Categorical(logits=t))
        )
        torch.testing.assert_close(kl, ref, atol=1e-5, rtol=1e-5)
        assert (kl >= -1e-6).all()
        for k in (1, 3, 7):
            coarse = topk_token_kl(s, *teacher_topk(t, k), kind)
            assert (coarse >= -1e-6).all()
            # Coarse-graining never increases a KL: the top-k loss bounds the full one from below.
            assert (coarse <= kl + 1e-5).all()
        # k = V: the rest bucket is empty on both sides, the full KL.
        torch.testing.assert_close(topk_token_kl(s, *teacher_topk(t, 11), kind), kl, atol=1e-5, rtol=1e-5)


def test_forward_and_reverse_kl_differ() -> None:
    """A bimodal teacher and a student on one of its modes: the mass-covering forward KL
    punishes the missing mode far more than the mode-seeking reverse KL does."""
    teacher = torch.log(torch.tensor([[0.5, 0.5, 1e-6]]))
    student = torch.log(torch.tensor([[0.98, 0.01, 0.01]]))
    fwd = token_kl(student, teacher, "forward").item()
    rev = token_kl(student, teacher, "reverse").item()
    assert fwd == pytest.approx(0.5 * math.log(0.5 / 0.98) + 0.5 * math.log(0.5 / 0.01), rel=1e-4)
    expected = 0.98 * math.log(0.98 / 0.5) + 0.01 * math.log(0.01 / 0.5) + 0.01 * math.log(0.01 / 1e-6)
    assert rev == pytest.approx(expected, rel=1e-3)
    assert fwd > 1.5 * rev


def test_kl_gradients() -> None:
    """d KL(T || S) / d s = softmax(s) - softmax(t): the distillation cross-entropy gradient;
    d KL(S || T) / d s = p_S * (log p_S - log p_T - KL)."""
    s, t = logits_pair(3, shape=(4, 9))
    x = s.clone().requires_grad_(True)
    token_kl(x, t, "forward").sum().backward()
    torch.testing.assert_close(x.grad, torch.softmax(s, -1) - torch.softmax(t, -1), atol=1e-5, rtol=1e-5)
    y = s.clone().requires_grad_(True)
    rev = token_kl(y, t, "reverse")
    rev.sum().backward()
    ls, lt = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    torch.testing.assert_close(y.grad, ls.exp() * (ls - lt - rev.detach()[:, None]), atol=1e-5, rtol=1e-5)


def test_topk_rest_bucket_and_mask() -> None:
    s, t = logits_pair(4)
    logprobs, ids = teacher_topk(t, 3)
    assert logprobs.shape == (3, 5, 4) and ids.shape == (3, 5, 3)
    p = torch.softmax(t.double(), -1)
    top = p.gather(-1, ids)
    torch.testing.assert_close(logprobs[..., :3].double(), top.log(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logprobs[..., 3].double(), (1 - top.sum(-1)).log(), atol=1e-5, rtol=1e-4)
    assert teacher_topk(t, 11)[0][..., -1].eq(float("-inf")).all()
    # Masked tokens do not count, whatever their logits; the mean is over valid tokens only.
    mask = torch.zeros(3, 5)
    mask[0, :2] = 1.0
    mask[2, 4] = 1.0
    kl = token_kl(s, t)
    assert opd_loss(s, t, mask).item() == pytest.approx(float(kl[mask.bool()].mean()), rel=1e-5)
    s2 = s.clone()
    s2[~mask.bool()] = 1e4 * torch.randn_like(s2[~mask.bool()])
    assert opd_loss(s2, t, mask).item() == pytest.approx(opd_loss(s, t, mask).item(), rel=1e-6)
    assert opd_loss(s, t, torch.zeros(3, 5)).item() == 0.0
    with pytest.raises(ValueError):
        token_kl(s, t, "sideways")


# ---------------------------------------------------- teacher and alignment


def test_teacher_targets_align_with_the_ar_model(tok) -> None:
    """One causal forward: the teacher's log-prob of each response token is sequence_logprobs'."""
    teacher = tiny_model(tok, seed=0, scale=0.3)
    prompts = random_prompts(tok, 4, seed=1)
    responses = [[8, 9, 3], [10], [11, 12, 13, 14, 15], [7, 7]]
    full = teacher_targets(teacher, prompts, responses, tok.pad_token_id)
    top = teacher_targets(teacher, prompts, responses, tok.pad_token_id, top_k=5)
    with torch.no_grad():
        ref, _ = sequence_logprobs(teacher, prompts, responses, tok.pad_token_id)
    for i, r in enumerate(responses):
        (lp,) = full[i]
        assert lp.shape == (len(r), len(tok))
        at_tokens = lp.gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        torch.testing.assert_close(at_tokens, ref[i, : len(r)], atol=1e-5, rtol=0)
        assert top[i][0].shape == (len(r), 6) and top[i][1].shape == (len(r), 5)


def test_loss_is_zero_when_student_and_teacher_agree(tok) -> None:
    """B=1 student = the teacher's weights: its replayed distribution on its own rollouts is the
    teacher's causal one at every response position (same token shift), so the KL is 0."""
    teacher = tiny_model(tok, seed=0, scale=0.3)
    student = convert_to_block_diffusion(teacher, tok, 1)
    # lr must be > 0 (OPDConfig); this small, the update changes nothing.
    cfg = OPDConfig(rollouts_per_prompt=3, prompts_per_step=4, steps=1, lr=1e-12, max_new_tokens=6, threshold=0.5)
    for kind, k in (("forward", 0), ("reverse", 0), ("forward", 5)):
        run_cfg = replace(cfg, kind=kind, teacher_top_k=k)
        result = train_opd(student, teacher, tok, random_prompts(tok, 8, seed=2), run_cfg)
        h = result.history[0]
        assert h["kl"] < 1e-5 and h["response_length"] > 1
        assert h["canvases_per_rollout"] == 1.0  # B = 1: one canvas, the AR view


def test_train_opd_moves_the_student_toward_the_teacher(tok) -> None:
    """A block-4 student from other random weights: the on-policy KL (fresh rollouts each
    step) falls. (Measured: 1.22 -> 0.72 over 15 steps.)"""
    teacher = tiny_model(tok, seed=0, scale=0.3)
    student = convert_to_block_diffusion(tiny_model(tok, seed=1), tok, 4)
    cfg = OPDConfig(rollouts_per_prompt=4, prompts_per_step=4, steps=15, minibatch_size=16, lr=3e-3, threshold=0.5,
                    max_new_tokens=8)
    seen: list[dict[str, float]] = []
    result = train_opd(student, teacher, tok, random_prompts(tok, 16, seed=4), cfg, on_step=seen.append)
    assert seen == result.history and len(seen) == 15
    assert {"kl", "kl_last_pass", "response_length", "tokens_per_forward", "canvases_per_rollout", "replay_rows",
            "teacher_s", "update_s"} <= set(seen[0])
    first = sum(h["kl"] for h in seen[:3]) / 3
    last = sum(h["kl"] for h in seen[-3:]) / 3
    assert last < 0.75 * first, (first, last)
    assert 1.0 <= seen[0]["canvases_per_rollout"] <= 4.0  # at most B canvases per trajectory
    assert not result.model.training


def test_train_opd_reverse_top_k_and_reward_monitoring(tok) -> None:
    teacher = tiny_model(tok, seed=0, scale=0.3)
    student = convert_to_block_diffusion(tiny_model(tok, seed=1), tok, 2)
    cfg = OPDConfig(rollouts_per_prompt=2, prompts_per_step=4, steps=10, minibatch_size=4, inner_epochs=2, lr=3e-3,
                    threshold=0.5, max_new_tokens=6, kind="reverse", teacher_top_k=4)
    result = train_opd(student, teacher, tok, random_prompts(tok, 8, seed=5), cfg,
                       reward_fn=lambda i, c: (float(len(c)), {"long": float(len(c) == 6)}))
    h = result.history
    assert all("reward_mean" in x and "long" in x for x in h)
    assert h[0]["reward_mean"] == pytest.approx(h[0]["response_length"])
    # Two passes per step: the second sees the first's updates.
    assert sum(x["kl_last_pass"] for x in h) < sum(x["kl"] for x in h)
    assert sum(x["kl"] for x in h[-3:]) < sum(x["kl"] for x in h[:3])


def test_train_opd_checks_its_inputs(tok) -> None:
    teacher = tiny_model(tok)
    with pytest.raises(ValueError, match="block-diffusion"):
        train_opd(tiny_model(tok), teacher, tok, [[8, 9]], OPDConfig(steps=1))  # not converted
    with pytest.raises(ValueError, match="no prompts"):
        train_opd(convert_to_block_diffusion(tiny_model(tok), tok, 4), teacher, tok, [], OPDConfig(steps=1))
    with pytest.raises(ValueError):
        OPDConfig(kind="sideways")
    with pytest.raises(ValueError):
        OPDConfig(sub_block_size=0)
    with pytest.raises(ValueError, match="divide block_size 4"):
        train_opd(convert_to_block_diffusion(tiny_model(tok), tok, 4), teacher, tok, [[8, 9]],
                  OPDConfig(steps=1, sub_block_size=3))


def test_train_opd_with_sub_blocks(tok) -> None:
    """The rollouts decode sub-block by sub-block: at threshold 0 a forward commits one whole
    sub-block of 2 per row (a block of 4 without sub-blocks), and the update runs on them."""
    teacher = tiny_model(tok, seed=0, scale=0.3)
    student = convert_to_block_diffusion(tiny_model(tok, seed=1), tok, 4)
    cfg = OPDConfig(rollouts_per_prompt=2, prompts_per_step=4, steps=1, minibatch_size=8, lr=1e-3, threshold=0.0,
                    max_new_tokens=8, sub_block_size=2)
    prompts = random_prompts(tok, 8, seed=2)
    h = train_opd(student, teacher, tok, prompts, cfg).history[0]
    assert h["response_length"] > 2 and 1.0 < h["tokens_per_forward"] <= 2.0
    assert math.isfinite(h["kl"])
    whole = train_opd(convert_to_block_diffusion(tiny_model(tok, seed=1), tok, 4), teacher, tok, prompts,
                      replace(cfg, sub_block_size=None)).history[0]
    assert whole["tokens_per_forward"] > 2.0


def _distil(tok, prompts: list[list[int]], cfg: OPDConfig, acc=None) -> OPDResult:
    teacher = tiny_model(tok, seed=0, scale=0.3)
    student = convert_to_block_diffusion(tiny_model(tok, seed=1), tok, 4)
    return train_opd(student, teacher, tok, prompts, cfg, accelerator=acc)


def _opd_worker(tok, prompts: list[list[int]], cfg: OPDConfig, out) -> None:
    """One of two processes (forked by debug_launcher): distil, save the weights."""
    two_process_worker(out, lambda acc: _distil(tok, prompts, cfg, acc))


def test_train_opd_on_two_processes(tok, tmp_path) -> None:
    """Two CPU processes under DDP with uneven shares (3 prompts per step: 2 and 1, and
    minibatches of 2 rollouts, so one process has an empty minibatch each step): no
    deadlock, the replicas stay equal, the run equals one process, the KL falls."""
    cfg = OPDConfig(rollouts_per_prompt=2, prompts_per_step=3, steps=12, minibatch_size=2, lr=2e-3, threshold=0.5,
                    max_new_tokens=8)
    prompts = random_prompts(tok, 16, seed=4)
    debug_launcher(_opd_worker, args=(tok, prompts, cfg, tmp_path), num_processes=2)
    history = equals_one_process(tmp_path, _distil(tok, prompts, cfg))
    assert len(history) == 12
    assert sum(h["kl"] for h in history[-3:]) < sum(h["kl"] for h in history[:3])


def test_micro_batches_take_the_same_step(tok) -> None:
    """Gradient accumulation over parts of a minibatch is the whole minibatch's step."""
    prompts = random_prompts(tok, 8, seed=6)
    cfg = OPDConfig(rollouts_per_prompt=3, prompts_per_step=2, steps=2, minibatch_size=6, lr=3e-3, threshold=0.5,
                    max_new_tokens=6, micro_batch_columns=0)
    runs = []
    for micro in (0, 1, 60):
        student = convert_to_block_diffusion(tiny_model(tok, seed=1), tok, 4)
        runs.append(train_opd(student, tiny_model(tok, seed=0, scale=0.3), tok, prompts,
                              replace(cfg, micro_batch_columns=micro)))
    for other in runs[1:]:
        assert [h["kl"] for h in other.history] == pytest.approx([h["kl"] for h in runs[0].history], abs=1e-5)
        pairs = zip(runs[0].model.parameters(), other.model.parameters())
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in pairs)


def test_train_opd_keeps_the_cft_loss_it_is_anchored_to() -> None:
    """With cft_weight > 0 every optimizer step also trains the anchor (called once per step,
    numbered in order): the student ends nearer CFT's loss than the same run without it."""
    tok, items = toy_tokenizer(), toy_items()
    examples = toy_examples(items)
    ccfg = CFTConfig(block_size=4)
    prompts = [encode_cft_example(tok, p, r, ccfg)["prompt_ids"] for p, r in examples[:8]]
    teacher = toy_model(tok, seed=0)
    cfg = OPDConfig(rollouts_per_prompt=2, prompts_per_step=4, steps=6, minibatch_size=4, lr=3e-3, threshold=0.5,
                    max_new_tokens=8)
    anchor = CFTAnchor(tok, examples, ccfg, batch_size=4)
    calls: list[int] = []

    def recording(model, device, call):
        calls.append(call)
        return anchor(model, device, call)

    plain = train_opd(convert_to_block_diffusion(toy_model(tok, seed=1), tok, 4), teacher, tok, prompts, cfg)
    kept = train_opd(convert_to_block_diffusion(toy_model(tok, seed=1), tok, 4), teacher, tok, prompts,
                     replace(cfg, cft_weight=5.0), anchor=recording)
    assert calls == list(range(6 * 2))  # 8 rollouts a step in minibatches of 4
    assert all(h["cft_loss"] > 0 for h in kept.history) and "cft_loss" not in plain.history[0]
    probe = CFTAnchor(tok, examples, ccfg, batch_size=len(examples), seed=9)
    with torch.no_grad():
        assert float(probe(kept.model, torch.device("cpu"), 0)) < 0.8 * float(probe(plain.model, torch.device("cpu"), 0))
    with pytest.raises(ValueError, match="anchor"):
        train_opd(convert_to_block_diffusion(toy_model(tok), tok, 4), teacher, tok, prompts, replace(cfg, cft_weight=1.0))
