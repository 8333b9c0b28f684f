"""CFT: the training layout (mask, positions, token shift) element by element, its exactness
against the AR model (block size 1) and against the inference view, the complementary
noise, the loss, and a tiny model that trains deterministically."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate import debug_launcher

from gr2model.models.block_diffusion import block_causal_mask, convert_to_block_diffusion
from gr2model.training.cft import (
    KIND_ANSWER,
    KIND_PAD,
    KIND_REASONING,
    CFTAnchor,
    CFTConfig,
    _loss_sums,
    block_diffusion_loss,
    build_cft_batch,
    complementary_masks,
    encode_cft_example,
    example_masks,
    prediction_sources,
    train_cft,
    training_attention_mask,
    training_position_ids,
)
from gr2model.decoding.diffusion_decode import diffusion_generate
from gr2model.task.rerank_format import ItemText, parse_response
from gr2model.training.sft import (
    IGNORE_INDEX,
    SFTConfig,
    collate_right_padded,
    encode_example,
    train_sft,
    weighted_lm_loss,
)
from gr2model.task.tokenizer import special_ids

from tiny import (
    TOY_CANDIDATES,
    agreeing_ranks,
    toy_examples,
    toy_items,
    toy_model,
    toy_tokenizer,
    two_process_worker,
)


@pytest.fixture(scope="module")
def items() -> ItemText:
    return toy_items()


@pytest.fixture(scope="module")
def tok():
    return toy_tokenizer()


def rows_of(text: str) -> list[list[bool]]:
    return [[ch == "1" for ch in line.split("#")[0].replace(" ", "")] for line in text.strip().splitlines()]


def inference_mask(prompt_len: int, length: int, block_size: int) -> torch.Tensor:
    """The decoder's rule, written independently: q attends k iff k <= q, or both are
    response positions of the same block. (1, 1, T, T) bool."""
    allowed = torch.zeros(length, length, dtype=torch.bool)
    for q in range(length):
        for k in range(length):
            both_response = q >= prompt_len and k >= prompt_len
            same = both_response and (q - prompt_len) // block_size == (k - prompt_len) // block_size
            allowed[q, k] = k <= q or same
    return allowed[None, None]


def forward(model, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits


# ---------------------------------------------------------------------- layout


def test_training_mask_element_by_element() -> None:
    """Row 0: p=2, L=4 (2 blocks of 2). Row 1: p=1, L=2, right padded to the same width."""
    mask = training_attention_mask(torch.tensor([2, 1]), torch.tensor([4, 2]), 2)
    assert mask.shape == (2, 1, 10, 10) and mask.dtype == torch.bool
    row0 = rows_of("""
        10 0000 0000   # P0
        11 0000 0000   # P1
        11 1100 0000   # N0  noisy block 0: prompt + itself
        11 1100 0000   # N1
        11 0011 1100   # N2  noisy block 1: prompt + clean block 0 + itself
        11 0011 1100   # N3
        11 0000 1100   # C0  clean block 0: prompt + itself
        11 0000 1100   # C1
        11 0000 1111   # C2  clean block 1: prompt + clean blocks 0, 1
        11 0000 1111   # C3
    """)
    row1 = rows_of("""
        1 00 00 00000  # P0
        1 11 00 00000  # N0
        1 11 00 00000  # N1
        1 00 11 00000  # C0
        1 00 11 00000  # C1
        0 00 00 10000  # pads attend themselves only
        0 00 00 01000
        0 00 00 00100
        0 00 00 00010
        0 00 00 00001
    """)
    assert mask[0, 0].tolist() == row0
    assert mask[1, 0].tolist() == row1
    pos = training_position_ids(torch.tensor([2, 1]), torch.tensor([4, 2]))
    assert pos.tolist() == [[0, 1, 2, 3, 4, 5, 2, 3, 4, 5], [0, 1, 2, 1, 2, 0, 0, 0, 0, 0]]
    # s0 <- last prompt token; s1 <- noisy s0; s2 (first of block 1) <- clean s1; s3 <- noisy s2.
    assert prediction_sources(2, 4, 2).tolist() == [1, 2, 7, 4]
    assert prediction_sources(1, 2, 2).tolist() == [0, 1]
    assert prediction_sources(3, 3, 1).tolist() == [2, 6, 7]  # B=1: always the clean previous token
    with pytest.raises(ValueError):
        training_attention_mask(torch.tensor([2]), torch.tensor([3]), 2)  # not whole blocks
    with pytest.raises(ValueError):
        training_attention_mask(torch.tensor([0]), torch.tensor([2]), 2)  # no prompt


def test_block_size_one_is_the_ar_model(tok, items) -> None:
    """B=1: the clean copy's logits are the AR logits, and the loss of a mask pair is
    the SFT loss (each token read from the clean previous token, trained once)."""
    model = toy_model(tok)
    cfg = CFTConfig(block_size=1)
    pairs = [toy_examples(items)[0], (toy_examples(items)[5][0] + " <a_1>", toy_examples(items)[5][1])]
    enc = [encode_cft_example(tok, p, r, cfg) for p, r in pairs]
    gen = torch.Generator().manual_seed(0)
    masks = [complementary_masks(len(e["response_ids"]), 1, 0.0, gen) for e in enc]
    batch = build_cft_batch(enc, masks, block_size=1, mask_id=tok.mask_token_id, pad_id=tok.pad_token_id)
    logits = forward(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"])

    sft_enc = [encode_example(tok, p, r, SFTConfig()) for p, r in pairs]
    sft = collate_right_padded(sft_enc, tok.pad_token_id)
    ar_logits = forward(model, sft["input_ids"], None, torch.arange(sft["input_ids"].shape[1])[None].expand(2, -1))
    for i, e in enumerate(enc):
        p, L = len(e["prompt_ids"]), len(e["response_ids"])
        for row in (2 * i, 2 * i + 1):
            torch.testing.assert_close(logits[row, :p], ar_logits[i, :p], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(logits[row, p + L : p + 2 * L], ar_logits[i, p : p + L], atol=1e-5, rtol=1e-5)
    ours = block_diffusion_loss(logits, batch["targets"], batch["weights"])
    ref = weighted_lm_loss(ar_logits, sft["labels"], sft["weights"])
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    # The training path (logits only on the predicting columns) gives the same sums.
    with torch.no_grad():
        weighted, stats, _ = _loss_sums(model, batch)
    torch.testing.assert_close(weighted / stats[0], ref, atol=1e-5, rtol=1e-5)


def test_training_view_equals_the_inference_view(tok, items) -> None:
    """B=3: each response token's training logits (read at its prediction source) equal
    the logits the decoder computes for it when filling its block, given the same noisy
    block: a forward over [prompt, clean blocks < k, noisy block k] with the inference mask."""
    model = toy_model(tok, seed=1)
    bs = 3
    cfg = CFTConfig(block_size=bs)
    enc = encode_cft_example(tok, *toy_examples(items)[7], cfg)
    p, L = len(enc["prompt_ids"]), len(enc["response_ids"])
    masks = [complementary_masks(L, bs, 0.3, torch.Generator().manual_seed(3))]
    batch = build_cft_batch([enc], masks, block_size=bs, mask_id=tok.mask_token_id, pad_id=tok.pad_token_id)
    logits = forward(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    src = prediction_sources(p, L, bs)
    clean = torch.tensor(enc["prompt_ids"] + enc["response_ids"])
    for row in range(2):
        noisy = batch["input_ids"][row, p : p + L]
        for k in range(L // bs):
            seq = torch.cat([clean[: p + k * bs], noisy[k * bs : (k + 1) * bs]])
            n = len(seq)
            mask = inference_mask(p, n, bs)
            # the same rule as the decoder's module (the conventions agree)
            assert torch.equal(mask, block_causal_mask(torch.ones(1, n), p, bs))
            inf = forward(model, seq[None], mask, torch.arange(n)[None])
            # token kB+i is read at inference position p + kB + i - 1
            for i in range(bs):
                s = k * bs + i
                torch.testing.assert_close(logits[row, src[s]], inf[0, p + s - 1], atol=1e-5, rtol=1e-5)


def test_padded_rows_equal_unpadded_rows(tok, items) -> None:
    """Right padding changes nothing: each row's logits equal the same row alone."""
    model = toy_model(tok)
    cfg = CFTConfig(block_size=2)
    pairs = [toy_examples(items)[0], (toy_examples(items)[1][0] + " <a_1> <b_2>", toy_examples(items)[1][1])]
    enc = [encode_cft_example(tok, p, r, cfg) for p, r in pairs]
    masks = [example_masks(len(e["response_ids"]), cfg, epoch=0, index=i) for i, e in enumerate(enc)]
    kw = {"block_size": 2, "mask_id": tok.mask_token_id, "pad_id": tok.pad_token_id}
    both = build_cft_batch(enc, masks, **kw)
    assert (both["input_ids"] == tok.pad_token_id).any()
    logits = forward(model, both["input_ids"], both["attention_mask"], both["position_ids"])
    assert torch.isfinite(logits).all()
    for i in range(2):
        alone = build_cft_batch([enc[i]], [masks[i]], **kw)
        width = alone["input_ids"].shape[1]
        ref = forward(model, alone["input_ids"], alone["attention_mask"], alone["position_ids"])
        torch.testing.assert_close(logits[2 * i : 2 * i + 2, :width], ref, atol=1e-5, rtol=1e-5)
        for key in ("input_ids", "targets", "weights"):
            assert torch.equal(both[key][2 * i : 2 * i + 2, :width], alone[key])
        assert (both["targets"][2 * i : 2 * i + 2, width:] == IGNORE_INDEX).all()


# ----------------------------------------------------------------------- noise


def test_complementary_pair_masks_every_response_token_once(tok, items) -> None:
    cfg = CFTConfig(block_size=4, reasoning_weight=0.5, answer_weight=3.0, pad_weight=0.25)
    enc = [encode_cft_example(tok, p, r, cfg) for p, r in toy_examples(items)[:3]]
    masks = [example_masks(len(e["response_ids"]), cfg, epoch=0, index=i) for i, e in enumerate(enc)]
    batch = build_cft_batch(enc, masks, block_size=4, mask_id=tok.mask_token_id, pad_id=tok.pad_token_id)
    for i, e in enumerate(enc):
        assert masks[i].sum(0).tolist() == [1] * len(e["response_ids"])
        p, L = len(e["prompt_ids"]), len(e["response_ids"])
        rows = batch["input_ids"][2 * i : 2 * i + 2]
        resp = torch.tensor(e["response_ids"])
        assert (rows[:, :p] == torch.tensor(e["prompt_ids"])).all()  # prompt never masked
        assert (rows[:, p + L : p + 2 * L] == resp).all()  # clean copy never masked
        is_mask = rows[:, p : p + L] == tok.mask_token_id
        assert torch.equal(is_mask, masks[i]) and is_mask.sum(0).tolist() == [1] * L
        assert (rows[:, p : p + L][~is_mask] == resp.expand(2, -1)[~is_mask]).all()
        # Across the pair, each response token is a target exactly once, at its source,
        # with its weight: the pair's total weight is the example's.
        targets, weights = batch["targets"][2 * i : 2 * i + 2], batch["weights"][2 * i : 2 * i + 2]
        src = prediction_sources(p, L, 4)
        assert torch.equal(targets[:, src][masks[i]], resp.expand(2, -1)[masks[i]])
        assert int((targets != IGNORE_INDEX).sum()) == L
        assert weights.sum().item() == pytest.approx(sum(e["weights"]))
        assert (targets[:, : p - 1] == IGNORE_INDEX).all()  # no prompt token is ever predicted


def test_suffix_masks_are_a_clean_prefix_then_masks() -> None:
    gen = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    plain = complementary_masks(64, 8, 0.0, gen())
    # suffix_prob 0 draws what it always drew.
    assert torch.equal(complementary_masks(64, 8, 0.0, gen(), suffix_prob=0.0), plain)
    pair = complementary_masks(64, 8, 0.0, gen(), suffix_prob=1.0)
    assert torch.equal(pair[0], ~pair[1])
    blocks = pair[0].view(8, 8).long()
    # Within each block: False* then True* (non-decreasing), cut points varied.
    assert bool((blocks[:, 1:] >= blocks[:, :-1]).all())
    assert len({int(b.sum()) for b in blocks}) > 1
    half = complementary_masks(8 * 400, 8, 0.0, gen(), suffix_prob=0.5)[0].view(400, 8).long()
    monotone = (half[:, 1:] >= half[:, :-1]).all(1).float().mean().item()
    assert 0.5 < monotone < 0.75  # the suffix half, plus i.i.d. blocks that happen to be monotone


def test_noise_levels_and_seeds() -> None:
    g = torch.Generator().manual_seed(0)
    assert complementary_masks(8, 4, 1.0, g)[0].all()  # t = 1: everything masked in the first row
    many = complementary_masks(40_000, 4, 0.5, torch.Generator().manual_seed(1))
    assert many[0].float().mean().item() == pytest.approx(0.75, abs=0.01)  # E[t] for t ~ U(0.5, 1)
    # Per-block levels: the masked fraction varies between blocks far more than iid tokens would.
    per_block = complementary_masks(4_000, 100, 0.0, torch.Generator().manual_seed(2))[0].view(40, 100).float().mean(1)
    assert per_block.std().item() > 0.2
    a = complementary_masks(12, 4, 0.0, torch.Generator().manual_seed(5))
    b = complementary_masks(12, 4, 0.0, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    cfg = CFTConfig(block_size=4)
    assert torch.equal(example_masks(64, cfg, epoch=1, index=3), example_masks(64, cfg, epoch=1, index=3))
    assert not torch.equal(example_masks(64, cfg, epoch=1, index=3), example_masks(64, cfg, epoch=2, index=3))
    assert not torch.equal(example_masks(64, cfg, epoch=1, index=3), example_masks(64, cfg, epoch=1, index=4))
    with pytest.raises(ValueError):
        complementary_masks(6, 4, 0.0, g)


# ------------------------------------------------------------------------ loss


def test_loss_reads_only_masked_tokens_at_their_sources(tok, items) -> None:
    cfg = CFTConfig(block_size=4)
    enc = encode_cft_example(tok, *toy_examples(items)[2], cfg)
    p, L = len(enc["prompt_ids"]), len(enc["response_ids"])
    masks = [example_masks(L, cfg, epoch=0, index=0)]
    batch = build_cft_batch([enc], masks, block_size=4, mask_id=tok.mask_token_id, pad_id=tok.pad_token_id)
    logits = torch.randn(2, p + 2 * L, len(tok), generator=torch.Generator().manual_seed(0), requires_grad=True)
    loss = block_diffusion_loss(logits, batch["targets"], batch["weights"])
    loss.backward()
    touched = logits.grad.abs().sum(-1) > 0  # (2, T)
    src = prediction_sources(p, L, 4)
    expected = torch.zeros(2, p + 2 * L, dtype=torch.bool)
    for row in range(2):
        expected[row, src[masks[0][row]]] = True
    assert torch.equal(touched, expected)
    assert not touched[:, : p - 1].any()  # prompt predictions get no gradient
    # Clean-copy columns other than block ends (the sources of first tokens) get none either.
    clean_cols = torch.arange(p + L, p + 2 * L)
    assert not touched[:, clean_cols[(clean_cols - p - L) % 4 != 3]].any()
    # Only the ratios of the weights matter; no weight: 0, not nan.
    base = block_diffusion_loss(logits, batch["targets"], batch["weights"])
    torch.testing.assert_close(block_diffusion_loss(logits, batch["targets"], 3 * batch["weights"]), base)
    assert block_diffusion_loss(logits, batch["targets"], torch.zeros_like(batch["weights"])).item() == 0.0


def test_teacher_columns_predict_the_same_tokens(tok, items) -> None:
    """Each target's teacher column is the AR column that predicts the same response token."""
    cfg = CFTConfig(block_size=4)
    encs = [encode_cft_example(tok, *ex, cfg) for ex in toy_examples(items)[:3]]
    masks = [example_masks(len(e["response_ids"]), cfg, epoch=0, index=i) for i, e in enumerate(encs)]
    batch = build_cft_batch(encs, masks, block_size=4, mask_id=tok.mask_token_id, pad_id=tok.pad_token_id)
    keep = batch["targets"] != -100
    assert torch.equal(keep, batch["teacher_cols"] >= 0)
    rows = torch.arange(keep.shape[0])[:, None].expand_as(keep)[keep] // 2
    # The AR shift: column c of the teacher's row predicts the token at column c + 1.
    assert torch.equal(batch["teacher_ids"][rows, batch["teacher_cols"][keep] + 1], batch["targets"][keep])
    for i, e in enumerate(encs):
        n = len(e["prompt_ids"]) + len(e["response_ids"])
        assert batch["teacher_attention"][i].sum().item() == n
        assert batch["teacher_ids"][i, :n].tolist() == e["prompt_ids"] + e["response_ids"]


def test_distillation_needs_a_teacher_and_pulls_toward_it(tok, items) -> None:
    examples = toy_examples(items)[:8]
    cfg = CFTConfig(epochs=3, batch_size=4, lr=3e-3, warmup_steps=1, block_size=4, kd_weight=1.0)
    with pytest.raises(ValueError, match="teacher"):
        train_cft(toy_model(tok), tok, examples, cfg)
    teacher = toy_model(tok, seed=7)
    enc = [encode_cft_example(tok, *ex, cfg) for ex in examples]
    masks = [example_masks(len(e["response_ids"]), cfg, epoch=0, index=i) for i, e in enumerate(enc)]
    batch = build_cft_batch(enc, masks, block_size=4, mask_id=tok.mask_token_id, pad_id=tok.pad_token_id)

    def kd_term(model) -> float:
        """The batch's loss with the distillation term minus the plain NLL: the weighted KL."""
        with torch.no_grad():
            with_kd = _loss_sums(model, batch, teacher, 1.0)[0]
            plain = _loss_sums(model, batch)[0]
        return (with_kd - plain).item()

    student = toy_model(tok)
    before = kd_term(student)
    assert before > 0  # two different models disagree somewhere
    strong = CFTConfig(epochs=3, batch_size=4, lr=3e-3, warmup_steps=1, block_size=4, kd_weight=50.0)
    trained = train_cft(student, tok, examples, strong, teacher=teacher).model
    assert kd_term(trained) < before
    assert all(not p.requires_grad for p in teacher.parameters())  # frozen, never updated


def test_encoding_pads_to_whole_blocks_and_cuts_to_whole_blocks(tok, items) -> None:
    prompt, response = toy_examples(items)[0]
    cfg = CFTConfig(block_size=8, reasoning_weight=0.5, answer_weight=3.0, pad_weight=0.25)
    sft = encode_example(tok, prompt, response, cfg.sft_config())
    n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    enc = encode_cft_example(tok, prompt, response, cfg)
    r = len(sft["input_ids"]) - n_prompt  # response + eos
    L = len(enc["response_ids"])
    assert enc["prompt_ids"] == sft["input_ids"][:n_prompt]
    assert L % 8 == 0 and L - r < 8 and L > r  # this response is not a whole number of blocks
    assert enc["response_ids"] == sft["input_ids"][n_prompt:] + [tok.eos_token_id] * (L - r)
    assert enc["weights"] == sft["weights"][n_prompt:] + [0.25] * (L - r)
    assert enc["kind"][r:] == [KIND_PAD] * (L - r) and enc["kind"][r - 1] == KIND_ANSWER
    assert KIND_REASONING in enc["kind"]
    # Cut by max_length: no eos, cut down to whole blocks.
    cut = encode_cft_example(tok, prompt, response, CFTConfig(block_size=8, max_length=n_prompt + 13))
    assert cut["response_ids"] == sft["input_ids"][n_prompt : n_prompt + 8]
    assert KIND_PAD not in cut["kind"]
    too_short = CFTConfig(block_size=8, max_length=n_prompt + 7)  # less than one block of response
    assert encode_cft_example(tok, prompt, response, too_short)["response_ids"] == []
    with pytest.raises(ValueError):
        encode_cft_example(tok, "", response, cfg)


# ----------------------------------------------------------------------- train


def test_train_cft_lowers_the_loss(tok, items) -> None:
    examples = toy_examples(items)
    seen: list[dict[str, float]] = []
    cfg = CFTConfig(epochs=15, batch_size=8, lr=5e-3, warmup_steps=3, block_size=4, valid_every=9)
    result = train_cft(toy_model(tok), tok, examples, cfg, valid=examples[:6], on_step=seen.append)
    assert result.steps == 15 * 3 and seen == result.history
    steps = [h for h in seen if "loss" in h]
    valids = [h for h in seen if "valid_loss" in h]
    assert len(steps) == 45
    # after each epoch (3 steps) and every 9 steps, never twice after the same step
    assert [h["step"] for h in valids] == [float(s) for s in range(3, 46, 3)]
    assert {"loss", "reasoning_loss", "answer_loss", "lr", "tokens_per_s", "grad_norm"} <= set(steps[0])
    first = sum(h["loss"] for h in steps[:3]) / 3
    last = sum(h["loss"] for h in steps[-3:]) / 3
    assert last < 0.3 * first
    assert valids[-1]["valid_loss"] < 0.3 * valids[0]["valid_loss"]
    assert not result.model.training


def test_train_cft_is_deterministic(tok, items) -> None:
    examples = toy_examples(items)[:10]
    cfg = CFTConfig(epochs=2, batch_size=4, lr=1e-3, warmup_steps=2, seed=3, block_size=2)

    def run():
        r = train_cft(toy_model(tok), tok, examples, cfg)
        return [{k: v for k, v in h.items() if k != "tokens_per_s"} for h in r.history], r.model

    h1, m1 = run()
    h2, m2 = run()
    assert h1 == h2
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))


def _cft_worker(tok, examples: list[tuple[str, str]], valid: list[tuple[str, str]], cfg: CFTConfig, out: Path) -> None:
    """One of two processes (forked by debug_launcher): train, save the weights."""
    two_process_worker(out, lambda acc: train_cft(toy_model(tok), tok, examples, cfg, valid=valid, accelerator=acc))


def test_two_processes_equal_one_process_with_the_global_batch(tok, items, tmp_path: Path) -> None:
    """DDP over 2 CPU processes equals 1 process at the same (global) batch_size, the
    partial last batch included (18 examples: 8, 8, 2): the noise of an example depends
    on (seed, epoch, example) only, and the loss is normalised by the global weight."""
    examples = toy_examples(items)[:18]
    valid = toy_examples(items)[18:23]
    cfg = CFTConfig(epochs=2, batch_size=8, lr=1e-3, warmup_steps=2, block_size=2)
    debug_launcher(_cft_worker, args=(tok, examples, valid, cfg, tmp_path), num_processes=2)
    rank0, history = agreeing_ranks(tmp_path)

    single = train_cft(toy_model(tok), tok, examples, cfg, valid=valid)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(rank0, single.model.parameters()))
    assert [sorted(h) for h in history] == [sorted(h) for h in single.history]
    for key in ("loss", "answer_loss", "valid_loss", "valid_reasoning_loss"):
        ours = [h[key] for h in history if key in h]
        assert ours and ours == pytest.approx([h[key] for h in single.history if key in h], abs=1e-5)


def test_train_cft_refuses_a_model_converted_for_another_block_size(tok, items) -> None:
    model = toy_model(tok)
    model.config.block_size = 8  # as gr2model.models.block_diffusion records it
    with pytest.raises(ValueError, match="block_size"):
        train_cft(model, tok, toy_examples(items)[:2], CFTConfig(block_size=4))


def test_cft_makes_the_naive_conversion_decode_valid_rankings(tok, items) -> None:
    """AR model trained by SFT on the toy task -> naive conversion (block 4, never saw
    a mask token): with the threshold decoder it either writes broken rankings or, where
    it stays valid, commits one token per row per forward (AR's pace: nothing decoded in
    parallel). A few CFT steps make it write the exact answers, several tokens per row
    per forward. (Measured: before the position tokens joined the vocabulary, naive 3/24
    valid; with them, naive 24/24 valid at 1.0 token per row per forward; after CFT
    24/24 exact at 2.3.)"""
    examples = toy_examples(items)
    sp = special_ids(tok)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p, _ in examples]
    bs = 4

    def decode(model) -> tuple[int, int, float]:
        out = diffusion_generate(
            model, prompts, pad_id=sp["pad"], eos_id=sp["eos"], mask_id=sp["mask"],
            block_size=bs, threshold=0.9, max_new_tokens=60,
        )
        texts = [tok.decode(s) for s in out.sequences]
        valid = sum(parse_response(t, list(c), items).valid_permutation for t, c in zip(texts, TOY_CANDIDATES))
        exact = sum(t == f"{r} <|eos|>" for t, (_, r) in zip(texts, examples))
        return valid, exact, out.tokens_per_forward / len(prompts)  # per row

    ar = train_sft(toy_model(tok), tok, examples, SFTConfig(epochs=40, batch_size=8, lr=3e-3, warmup_steps=10)).model
    naive = convert_to_block_diffusion(ar, tok, bs)
    naive_valid, _, naive_tpf = decode(naive)
    cfg = CFTConfig(epochs=15, batch_size=8, lr=3e-3, warmup_steps=5, block_size=bs)
    tuned = train_cft(naive, tok, examples, cfg).model
    valid, exact, tpf = decode(tuned)
    assert naive_valid <= 0.5 * len(examples) or naive_tpf <= 1.05
    assert valid >= 0.9 * len(examples) and exact >= 0.8 * len(examples)
    assert tpf > 1.5 and tpf > naive_tpf + 0.4


# ------------------------------------------------------------------- anchor


def test_anchor_draws_are_a_function_of_the_call_and_split_over_processes(tok, items) -> None:
    """Batch c walks a seeded shuffle, a fresh one per pass: every example once per pass, the
    same batch for the same call whatever came before, and two processes' shares together are
    one process's batch."""
    examples = toy_examples(items)[:10]
    cfg = CFTConfig(block_size=4)
    one = CFTAnchor(tok, examples, cfg, batch_size=4, seed=1)
    first_pass = [i for c in range(3) for p, i in one.draws(c) if p == 0]
    assert sorted(first_pass) == list(range(10))
    assert CFTAnchor(tok, examples, cfg, batch_size=4, seed=1).draws(5) == one.draws(5)
    assert CFTAnchor(tok, examples, cfg, batch_size=4, seed=2).draws(0) != one.draws(0)
    model = convert_to_block_diffusion(toy_model(tok), tok, 4)
    shares = [CFTAnchor(tok, examples, cfg, batch_size=4, seed=1, rank=r, world=2) for r in (0, 1)]
    assert shares[0].draws(2) == shares[1].draws(2) == one.draws(2) == one.share(2)  # one global batch
    assert sorted(shares[0].share(2) + shares[1].share(2)) == sorted(one.draws(2))
    assert torch.equal(one(model, torch.device("cpu"), 2), one(model, torch.device("cpu"), 2))


def test_anchor_is_the_cft_loss_of_its_batch_with_grad(tok, items) -> None:
    """The anchor's value is sum(w * nll) / sum(w) of `build_cft_batch` on its draws (noise of the
    epoch past CFT's own), and it trains: steps on it lower it."""
    examples = toy_examples(items)
    cfg = CFTConfig(block_size=4, epochs=2, answer_weight=3.0)
    anchor = CFTAnchor(tok, examples, cfg, batch_size=6, seed=0)
    model = convert_to_block_diffusion(toy_model(tok), tok, 4)
    drawn = anchor.draws(0)
    enc = [encode_cft_example(tok, *examples[i], cfg) for _, i in drawn]
    masks = [example_masks(len(e["response_ids"]), cfg, epoch=cfg.epochs + p, index=i) for e, (p, i) in zip(enc, drawn)]
    batch = build_cft_batch(enc, masks, block_size=4, mask_id=tok.mask_token_id, pad_id=tok.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], use_cache=False).logits
    want = block_diffusion_loss(logits, batch["targets"], batch["weights"])
    got = anchor(model, torch.device("cpu"), 0)
    assert got.requires_grad and float(got) == pytest.approx(float(want), rel=1e-5)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    for call in range(30):
        opt.zero_grad()
        anchor(model, torch.device("cpu"), call).backward()
        opt.step()
    with torch.no_grad():
        assert float(anchor(model, torch.device("cpu"), 0)) < 0.5 * float(want)
