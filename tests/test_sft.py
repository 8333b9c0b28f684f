"""SFT: the weighted loss (HF parity, prompt masking, weight placement) and a tiny model that learns a toy task."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader
from accelerate import Accelerator, debug_launcher

from gr2model.decoding.ar_decode import ar_generate
from gr2model.task.rerank_format import (
    FormatConfig,
    ItemText,
    build_full_text,
    build_prompt,
    build_response,
    parse_response,
)
from gr2model.training.sft import (
    IGNORE_INDEX,
    GlobalBatchShards,
    LengthGroupedBatches,
    SFTConfig,
    check_global_batches,
    collate_right_padded,
    decision_cross_entropy,
    encode_example,
    sft_loss_sums,
    run_train_loop,
    train_sft,
    warmup_cosine_factor,
    weighted_lm_loss,
)
from gr2model.task.tokenizer import special_ids

from tiny import agreeing_ranks, toy_examples, toy_items, toy_model, toy_tokenizer, two_process_worker


@pytest.fixture(scope="module")
def items() -> ItemText:
    return toy_items()


@pytest.fixture(scope="module")
def tok():
    return toy_tokenizer()


# ------------------------------------------------------------------------ loss


def test_weighted_loss_equals_hf_loss_with_unit_weights(tok) -> None:
    model = toy_model(tok)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(7, len(tok), (3, 12), generator=g)
    labels = ids.clone()
    labels[:, :5] = IGNORE_INDEX  # a prompt
    labels[2, 9:] = IGNORE_INDEX  # a shorter row
    out = model(input_ids=ids, labels=labels)
    ours = weighted_lm_loss(out.logits, labels, torch.ones(ids.shape))
    assert torch.allclose(ours, out.loss, atol=1e-6)


def test_weighted_loss_properties() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, 11, generator=g)
    labels = torch.randint(0, 11, (2, 6), generator=g)
    labels[:, 0] = IGNORE_INDEX
    w = torch.rand(2, 6, generator=g) + 0.1
    base = weighted_lm_loss(logits, labels, w)
    # Only the ratios of the weights matter.
    assert torch.allclose(weighted_lm_loss(logits, labels, 7.0 * w), base, atol=1e-6)
    # All weight on one token: the loss is that token's nll, predicted by the position before it.
    one = torch.zeros_like(w)
    one[1, 3] = 1.0
    nll = -torch.log_softmax(logits[1, 2], -1)[labels[1, 3]]
    assert torch.allclose(weighted_lm_loss(logits, labels, one), nll, atol=1e-6)
    # No weight anywhere: 0, not nan, and a zero gradient.
    x = logits.clone().requires_grad_(True)
    zero = weighted_lm_loss(x, labels, torch.zeros_like(w))
    zero.backward()
    assert zero.item() == 0.0 and torch.count_nonzero(x.grad) == 0


def test_prompt_tokens_never_contribute(tok, items) -> None:
    prompt, response = toy_examples(items)[0]
    enc = encode_example(tok, prompt, response, SFTConfig())
    n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    labels = torch.tensor([enc["labels"]])
    weights = torch.tensor([enc["weights"]])
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, labels.shape[1], len(tok), generator=g)
    base = weighted_lm_loss(logits, labels, weights)

    # A real label on a prompt token (weight still 0) changes nothing.
    relabeled = labels.clone()
    relabeled[0, :n_prompt] = torch.tensor(enc["input_ids"][:n_prompt])
    assert torch.equal(weighted_lm_loss(logits, relabeled, weights), base)
    # A weight on a prompt token (label still ignored) changes nothing.
    reweighted = weights.clone()
    reweighted[0, :n_prompt] = 5.0
    assert torch.equal(weighted_lm_loss(logits, labels, reweighted), base)
    # Logits at positions that predict prompt tokens (0 .. n_prompt-2), and at
    # the last position (predicts nothing), change nothing...
    noisy = logits.clone()
    noisy[0, : n_prompt - 1] += 100.0 * torch.randn(n_prompt - 1, len(tok), generator=g)
    noisy[0, -1] += 100.0 * torch.randn(len(tok), generator=g)
    assert torch.equal(weighted_lm_loss(noisy, labels, weights), base)
    # ...while the last prompt position predicts the first response token.
    noisy[0, n_prompt - 1] += 100.0 * torch.randn(len(tok), generator=g)
    assert not torch.allclose(weighted_lm_loss(noisy, labels, weights), base)


def test_loss_sums_from_the_kept_logits_equal_the_full_logits_loss(tok, items) -> None:
    """sft_loss_sums computes logits only where a token is predicted; its loss, its stats and
    its gradients must be those of the loss over the whole (B, T, V) logits."""
    examples = toy_examples(items)[:3]
    cfg = SFTConfig(answer_weight=3.0)
    enc = [encode_example(tok, p, r, cfg) for p, r in examples]
    enc[1] = {k: v[:-2] for k, v in enc[1].items()}  # rows of different lengths: right padding
    batch = collate_right_padded(enc, pad_id=tok.pad_token_id)
    model = toy_model(tok)

    weighted, stats, n_tokens = sft_loss_sums(model, batch)
    weighted.backward()
    kept = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    full = weighted_lm_loss(logits, batch["labels"], batch["weights"])
    (full * stats[0]).backward()

    assert float(weighted.detach() / stats[0]) == pytest.approx(float(full), rel=1e-5)
    assert int(n_tokens) == int(batch["attention_mask"].sum())
    for a, p in zip(kept, model.parameters()):
        assert torch.allclose(a, p.grad, rtol=1e-4, atol=1e-6)


def test_weights_land_on_the_right_tokens(tok, items) -> None:
    fc = FormatConfig(history_len=2, with_attributes=True)
    prompt = build_prompt([4, 1], [2, 3, 1], items, fc)
    response = build_response(["likes", "<a_1>", "because"], [3, 2, 1], items)
    cfg = SFTConfig(reasoning_weight=0.5, answer_weight=3.0)
    enc = encode_example(tok, prompt, response, cfg)

    # The ids are exactly the tokenization of the full training text.
    assert enc["input_ids"] == tok(build_full_text(prompt, response), add_special_tokens=False)["input_ids"]
    words = build_full_text(prompt, response).split()
    n_prompt = len(prompt.split())
    assert enc["labels"][:n_prompt] == [IGNORE_INDEX] * n_prompt
    assert enc["labels"][n_prompt:] == enc["input_ids"][n_prompt:]
    by_word = list(zip(words, enc["weights"], enc["reasoning"]))
    assert all(w == 0.0 for _, w, _ in by_word[:n_prompt])
    resp = by_word[n_prompt:]
    # { "explanation" : " likes <a_1> because " , "recommendations" : [ ... ] } <|eos|>
    assert [t for t, _, _ in resp[:4]] == ["{", '"explanation"', ":", '"']
    assert all(w == 3.0 and r == 0 for _, w, r in resp[:4])  # scaffolding before the explanation
    assert resp[4:7] == [("likes", 0.5, 1), ("<a_1>", 0.5, 1), ("because", 0.5, 1)]
    assert resp[7:10] == [('"', 3.0, 0), (",", 3.0, 0), ('"recommendations"', 3.0, 0)]
    assert all(w == 3.0 and r == 0 for _, w, r in resp[7:])  # ranking part, eos included
    assert resp[-1] == ("<|eos|>", 3.0, 0)

    # max_length cuts at the end.
    short = encode_example(tok, prompt, response, SFTConfig(max_length=n_prompt + 3))
    assert short["input_ids"] == enc["input_ids"][: n_prompt + 3]
    assert len(short["weights"]) == len(short["labels"]) == n_prompt + 3


def test_citation_weight_lands_on_the_reasonings_position_tokens(tok, items) -> None:
    """Reasoning first, index answer: the `<pos_k>` citations inside the explanation weigh
    citation_weight; the other reasoning words reasoning_weight; the answer's own position
    tokens answer_weight. Unset, the citations weigh as reasoning."""
    fc = FormatConfig(history_len=2, with_attributes=False, answer="index")
    cands = [2, 3, 1]
    prompt = build_prompt([4, 1], cands, items, fc)
    response = build_response(["pick", "<pos_2>", "<a_3>", "over", "<pos_1>"], [3, 2, 1], items, fmt=fc, candidates=cands)
    n_prompt = len(prompt.split())
    resp_words = build_full_text(prompt, response).split()[n_prompt:]
    enc = encode_example(tok, prompt, response, SFTConfig(reasoning_weight=0.5, answer_weight=3.0, citation_weight=7.0))
    by_word = list(zip(resp_words, enc["weights"][n_prompt:], enc["reasoning"][n_prompt:]))
    assert by_word[4:9] == [("pick", 0.5, 1), ("<pos_2>", 7.0, 1), ("<a_3>", 0.5, 1), ("over", 0.5, 1), ("<pos_1>", 7.0, 1)]
    answer_positions = [w for t, w, _ in by_word[9:] if t.startswith("<pos_")]
    assert answer_positions == [3.0, 3.0, 3.0]
    plain = encode_example(tok, prompt, response, SFTConfig(reasoning_weight=0.5, answer_weight=3.0))
    assert [w for t, w, _ in zip(resp_words, plain["weights"][n_prompt:], plain["reasoning"][n_prompt:]) if t == "<pos_2>"][0] == 0.5


def test_soft_decision_target_marks_the_first_position_token(tok, items) -> None:
    """With decision_weight and the teacher's scores, the response's first position token (the
    reasoning's first citation) carries softmax(scores / T) over the candidates' position tokens;
    no target when the written decision is not the teacher's best, or when the option is off."""
    fc = FormatConfig(history_len=2, with_attributes=False, answer="index")
    cands = [2, 3, 1]
    prompt = build_prompt([4, 1], cands, items, fc)
    response = build_response(["pick", "<pos_2>", "<a_3>", "over", "<pos_1>"], [3, 2, 1], items, fmt=fc, candidates=cands)
    scores = [0.5, 2.0, -1.0]  # the teacher's best is <pos_2>, the one the reasoning cites first
    cfg = SFTConfig(decision_weight=3.0, decision_temperature=2.0)
    enc = encode_example(tok, prompt, response, cfg, scores)
    assert tok.convert_ids_to_tokens(enc["input_ids"][enc["decision"]]) == "<pos_2>"
    assert enc["decision"] == len(prompt.split()) + 5  # { "explanation" : " pick <pos_2>
    assert tok.convert_ids_to_tokens(enc["decision_ids"]) == ["<pos_1>", "<pos_2>", "<pos_3>"]
    assert enc["decision_probs"] == pytest.approx(torch.softmax(torch.tensor(scores, dtype=torch.float64) / 2.0, 0).tolist())
    # The same ids, labels and weights as without the target.
    plain = encode_example(tok, prompt, response, SFTConfig())
    assert {k: enc[k] for k in plain} == plain and "decision" not in plain
    assert "decision" not in encode_example(tok, prompt, response, cfg, [3.0, 2.0, -1.0])  # best is <pos_1>
    assert "decision" not in encode_example(tok, prompt, response, SFTConfig(), scores)


def test_soft_decision_loss_adds_the_weighted_cross_entropy(tok, items) -> None:
    fc = FormatConfig(history_len=1, with_attributes=False, answer="index")
    cands = [2, 3, 1]
    prompt = build_prompt([4], cands, items, fc)
    response = build_response(["pick", "<pos_3>"], [1, 2, 3], items, fmt=fc, candidates=cands)
    cfg = SFTConfig(decision_weight=2.0)
    with_target = encode_example(tok, prompt, response, cfg, [0.0, 1.0, 3.0])
    without = encode_example(tok, prompt, response, cfg)
    batch = collate_right_padded([with_target, without], pad_id=tok.pad_token_id)
    assert batch["decision"].tolist() == [with_target["decision"], -1]
    assert batch["decision_probs"][1].tolist() == [0.0, 0.0, 0.0]
    model = toy_model(tok).eval()
    torch.set_grad_enabled(False)
    try:
        base_w, base_stats, _ = sft_loss_sums(model, batch)
        w, stats, _ = sft_loss_sums(model, batch, 2.0)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    finally:
        torch.set_grad_enabled(True)
    logp = torch.log_softmax(logits[0, with_target["decision"] - 1].float(), -1)
    manual = -sum(p * logp[i] for p, i in zip(with_target["decision_probs"], with_target["decision_ids"]))
    at = with_target["decision"] - 1
    ce = decision_cross_entropy(logits[:1, at], batch["decision_ids"][:1], batch["decision_probs"][:1])
    assert ce.shape == (1,) and float(ce[0]) == pytest.approx(float(manual), rel=1e-5)
    assert float(w) == pytest.approx(float(base_w) + 2.0 * float(manual), rel=1e-5)
    assert float(stats[0]) == pytest.approx(float(base_stats[0]) + 2.0)


def test_collate_right_pads() -> None:
    a = {"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "weights": [0.0, 1.0, 2.0], "reasoning": [0, 1, 0]}
    b = {"input_ids": [8], "labels": [8], "weights": [1.0], "reasoning": [0]}
    batch = collate_right_padded([a, b], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["weights"].tolist() == [[0.0, 1.0, 2.0], [1.0, 0.0, 0.0]]


def test_warmup_cosine_schedule() -> None:
    f = [warmup_cosine_factor(s, 4, 20) for s in range(20)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == 1.0
    assert all(a >= b for a, b in zip(f[4:], f[5:]))
    assert 0.0 < f[-1] < 0.05


# ----------------------------------------------------------------------- train


def test_train_sft_learns_a_deterministic_task(tok, items) -> None:
    examples = toy_examples(items)
    seen: list[dict[str, float]] = []
    cfg = SFTConfig(epochs=40, batch_size=8, lr=3e-3, warmup_steps=10)
    result = train_sft(toy_model(tok), tok, examples, cfg, valid=examples[:4], on_step=seen.append)

    assert result.steps == 40 * 3
    assert seen == result.history
    steps = [h for h in seen if "loss" in h]
    valids = [h for h in seen if "valid_loss" in h]
    assert len(steps) == 120 and len(valids) == 40
    assert {"loss", "reasoning_loss", "answer_loss", "lr", "tokens_per_s", "grad_norm"} <= set(steps[0])
    first = sum(h["loss"] for h in steps[:3]) / 3
    last = sum(h["loss"] for h in steps[-3:]) / 3
    assert last < 0.1 * first
    assert valids[-1]["valid_loss"] < 0.1 * valids[0]["valid_loss"]

    sp = special_ids(tok)
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p, _ in examples]
    out = ar_generate(result.model, prompt_ids, pad_id=sp["pad"], eos_id=sp["eos"], max_new_tokens=60)
    exact = sum(tok.decode(s) == f"{r} <|eos|>" for (_, r), s in zip(examples, out.sequences))
    assert exact >= 0.8 * len(examples)
    # The learned answers are valid, reversed rankings.
    parsed = parse_response(tok.decode(out.sequences[0]), [1, 2, 3], items)
    assert parsed.valid_permutation and parsed.ranking == [3, 2, 1]


def test_train_sft_is_deterministic(tok, items) -> None:
    examples = toy_examples(items)[:10]
    cfg = SFTConfig(epochs=2, batch_size=4, lr=1e-3, warmup_steps=2, seed=3)

    def run() -> tuple[list[dict[str, float]], torch.nn.Module]:
        r = train_sft(toy_model(tok), tok, examples, cfg)
        return [{k: v for k, v in h.items() if k != "tokens_per_s"} for h in r.history], r.model

    h1, m1 = run()
    h2, m2 = run()
    assert h1 == h2
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
    assert not m1.training


def _sft_worker(tok, examples: list[tuple[str, str]], valid: list[tuple[str, str]], cfg: SFTConfig, out: Path) -> None:
    """One of two processes (forked by debug_launcher): train, save the weights."""
    two_process_worker(out, lambda acc: train_sft(toy_model(tok), tok, examples, cfg, valid=valid, accelerator=acc))


def test_two_processes_equal_one_process_with_the_global_batch(tok, items, tmp_path: Path) -> None:
    """DDP over 2 CPU processes takes the same steps as 1 process at the same (global) batch_size.

    Every process draws the same seeded order of global batches and trains on its
    part of each (`GlobalBatchShards`), so a step sees the same examples, the last,
    partial batch included (18 examples: batches of 8, 8, 2); the loss is normalised by
    the global weight, so the gradients agree too. (The processes get the tokenizer
    and texts from the parent: polars' thread pool does not survive a fork.)
    """
    examples = toy_examples(items)[:18]
    valid = toy_examples(items)[18:23]  # 5: the processes score 3 and 2 of them
    cfg = SFTConfig(epochs=2, batch_size=8, lr=1e-3, warmup_steps=2)
    debug_launcher(_sft_worker, args=(tok, examples, valid, cfg, tmp_path), num_processes=2)
    rank0, history = agreeing_ranks(tmp_path)

    single = train_sft(toy_model(tok), tok, examples, cfg, valid=valid)
    assert single.steps == 6  # 3 batches (8, 8, 2) per epoch: the partial batch is a step of both runs
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(rank0, single.model.parameters()))
    assert [sorted(h) for h in history] == [sorted(h) for h in single.history]
    for key in ("loss", "answer_loss", "valid_loss", "valid_reasoning_loss"):
        ours = [h[key] for h in history if key in h]
        assert ours and ours == pytest.approx([h[key] for h in single.history if key in h], abs=1e-5)


def test_global_batch_shards_cut_every_global_batch_into_one_part_per_process() -> None:
    """Process r of N takes every N-th part (accelerate's round-robin deal): together the parts of
    a step are exactly one global batch, the partial last one included; one process: unchanged."""
    def batches() -> LengthGroupedBatches:  # a fresh sampler: each pass over one reshuffles
        return LengthGroupedBatches([3, 9, 1, 7, 5, 2, 8, 4, 6, 10, 11], batch_size=4, seed=1)

    global_batches = list(batches())
    assert sorted(len(b) for b in global_batches) == [3, 4, 4]  # one partial batch
    parts = list(GlobalBatchShards(batches(), 3))
    assert len(parts) == len(GlobalBatchShards(batches(), 3)) == 3 * len(global_batches)
    assert [sum(parts[3 * i : 3 * i + 3], []) for i in range(len(global_batches))] == global_batches
    assert all(max(map(len, parts[i : i + 3])) - min(map(len, parts[i : i + 3])) <= 1 for i in range(0, len(parts), 3))
    assert list(GlobalBatchShards(batches(), 1)) == global_batches


def test_a_batch_smaller_than_the_process_count_is_refused_before_any_work() -> None:
    check_global_batches(18, 8, 2)  # 8, 8, 2: every process gets an example of every step
    with pytest.raises(ValueError, match="batch of 1 examples, fewer than the 2 processes"):
        check_global_batches(17, 8, 2)
    with pytest.raises(ValueError, match="batch of 4 examples, fewer than the 8 processes"):
        check_global_batches(64, 4, 8)
    check_global_batches(17, 8, 1)


def test_one_process_draws_the_batches_a_shuffled_dataloader_draws(tok) -> None:
    """With one process the global batches are those of DataLoader(shuffle=True, generator
    seeded by cfg.seed), epoch after epoch: what the loop drew before batches became global,
    so single-process runs train exactly as they did."""
    seen: list[list[int]] = []

    def loss_sums(m, batch, epoch):
        seen.append(batch.tolist())
        zero = sum(p.sum() for p in m.parameters()) * 0.0  # a backward that changes nothing
        return zero, torch.zeros(6), torch.tensor(len(batch))

    cfg = SFTConfig(epochs=2, batch_size=4, seed=3, warmup_steps=0)
    run_train_loop(toy_model(tok), list(range(10)), torch.tensor, loss_sums, cfg, accelerator=Accelerator())
    loader = DataLoader(list(range(10)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3), collate_fn=torch.tensor)
    assert seen == [b.tolist() for _ in range(2) for b in loader]
    assert sorted(sum(seen[:3], [])) == list(range(10))  # 4, 4, 2: every example once an epoch
