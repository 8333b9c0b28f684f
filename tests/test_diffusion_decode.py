"""Block-diffusion decoding: commit rule, cache vs recompute, B = 1 is AR, NFE bounds, trace replay."""

from __future__ import annotations

import math

import pytest
import torch

from gr2model.ar_decode import ar_generate
from gr2model.block_diffusion import block_causal_mask
import gr2model.diffusion_decode as dd
from gr2model.diffusion_decode import DiffusionDecodeOutput, commit_mask, diffusion_generate, propose

from tiny import EOS, PAD, VOCAB, random_ids, random_model

NO_EOS = -1  # an id no token has: rows run to max_new_tokens
NEW = 20
# On this random model the top probabilities are mostly 0.05-0.4: 0.3 commits
# several tokens in some steps and one in others, and rows progress unevenly
# (every kind of cached step occurs, see test_cached_equals_recompute).
MIXED = 0.3


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    # The AR model itself: conversion is a weight copy (tested in
    # test_block_diffusion), and the decoder passes its own masks.
    return random_model()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_ids()


@pytest.fixture(scope="module")
def ar_ref(model, prompts) -> list[list[int]]:
    return ar_generate(model, prompts, pad_id=PAD, eos_id=NO_EOS, max_new_tokens=NEW).sequences


@pytest.fixture(scope="module")
def mask_id(ar_ref) -> int:
    # The decoder never commits the mask token; for the B = 1 parity with AR,
    # use a token that greedy AR decoding never emits here.
    used = {t for s in ar_ref for t in s}
    return min(set(range(3, VOCAB)) - used)


def decode(model, prompts, mask_id, **kw) -> DiffusionDecodeOutput:
    args = dict(pad_id=PAD, eos_id=NO_EOS, mask_id=mask_id, max_new_tokens=NEW, return_trace=True)
    args.update(kw)
    return diffusion_generate(model, prompts, **args)


# ---------------------------------------------------------------- commit rule


def test_commit_mask_by_hand() -> None:
    conf = torch.tensor([[0.9, 0.2, 0.95, 0.5], [0.1, 0.3, 0.2, 0.05], [0.99, 0.99, 0.1, 0.2]])
    masked = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1], [0, 0, 1, 0]], dtype=torch.bool)
    got = commit_mask(conf, masked, threshold=0.5)
    # Row 0: 0.9 and 0.5 pass (0.95 is already committed); row 1: none passes,
    # the most confident is forced; row 2: the only masked one, though below.
    assert got.tolist() == [[True, False, False, True], [False, True, False, False], [False, False, True, False]]
    assert commit_mask(conf, masked, threshold=2.0).sum(1).tolist() == [1, 1, 1]
    assert torch.equal(commit_mask(conf, masked, threshold=0.0), masked)
    # Nothing masked: nothing committed.
    assert not commit_mask(conf, torch.zeros_like(masked), threshold=0.0).any()


def test_commit_mask_properties() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        conf = torch.rand((6, 5), generator=g)
        masked = torch.rand((6, 5), generator=g) < 0.6
        tau = float(torch.rand((), generator=g))
        got = commit_mask(conf, masked, tau)
        assert not (got & ~masked).any()  # never an already committed position
        assert ((conf >= tau) & masked & ~got).sum() == 0  # every one above tau
        has = masked.any(1)
        assert (got.sum(1)[has] >= 1).all()  # progress on every row that can make it
        best = conf.masked_fill(~masked, -1).argmax(1)
        assert got[has, best[has]].all()  # the forced one is the most confident


def test_propose_greedy_confidence() -> None:
    logits = torch.tensor([[[1.0, 3.0, 0.0, 2.5]]])
    tokens, conf = propose(logits.clone(), 0.0, None)
    assert tokens.tolist() == [[1]]
    assert torch.allclose(conf, torch.softmax(logits, -1)[..., 1])
    # The banned (mask) id is never proposed, and confidences renormalise without it.
    tokens, conf = propose(logits.clone(), 0.0, None, banned_id=1)
    assert tokens.tolist() == [[3]]
    assert torch.allclose(conf, torch.softmax(logits[..., [0, 2, 3]], -1)[..., 2])


# ---------------------------------------------------------------- decoding


@pytest.mark.parametrize("block_size", [1, 4])
def test_cached_equals_recompute(model, prompts, mask_id, block_size, monkeypatch) -> None:
    # Record which kinds of cached forward ran, to be sure the ragged ones did.
    kinds: set[str] = set()
    call = dd._CachedForward.__call__

    def spy(self, resp, start, plen, ctx, ctx_list):
        ragged = min(self.kept) != max(self.kept)
        if ctx is None:
            kinds.add("prefill")
        elif not any(ctx_list):
            kinds.add("denoise ragged" if ragged else "denoise")
        else:
            kinds.add("finish some" if ragged or not all(ctx_list) else "finish all")
        return call(self, resp, start, plen, ctx, ctx_list)

    monkeypatch.setattr(dd._CachedForward, "__call__", spy)
    cached = decode(model, prompts, mask_id, block_size=block_size, threshold=MIXED)
    full = decode(model, prompts, mask_id, block_size=block_size, threshold=MIXED, use_cache=False)
    assert cached.sequences == full.sequences
    assert cached.steps == full.steps
    assert cached.nfe == full.nfe
    assert all(len(s) == NEW for s in cached.sequences)
    assert cached.generated_tokens == NEW * len(prompts)
    if block_size > 1:
        # Rows progress unevenly (the case the ragged cache exists for).
        assert len({tuple(s) for s in cached.steps}) > 1
        assert cached.nfe < NEW  # some steps committed several tokens
        assert kinds == {"prefill", "denoise", "denoise ragged", "finish some"}
    else:
        assert kinds == {"prefill", "finish all"}  # B = 1: every step finishes a block


def test_eos_stops_rows_cached_equals_recompute(model, prompts, mask_id) -> None:
    ref = decode(model, prompts, mask_id, block_size=4, threshold=MIXED).sequences
    eos = ref[0][5]  # a token row 0 emits mid-way: rows stop at different steps
    expected = [s[: s.index(eos) + 1] if eos in s else s for s in ref]
    assert len({len(s) for s in expected}) > 1
    outs = [decode(model, prompts, mask_id, block_size=4, threshold=MIXED, eos_id=eos, use_cache=c)
            for c in (True, False)]
    assert outs[0].sequences == outs[1].sequences and outs[0].steps == outs[1].steps
    assert outs[0].nfe == outs[1].nfe
    for seq in outs[0].sequences:
        assert eos not in seq[:-1]
        assert seq[-1] == eos or len(seq) == NEW
    assert outs[0].generated_tokens == sum(len(s) for s in outs[0].sequences)


def test_left_padding_does_not_change_a_row(model, prompts, mask_id) -> None:
    batched = decode(model, prompts, mask_id, block_size=4, threshold=MIXED)
    for i, prompt in enumerate(prompts):
        alone = decode(model, [prompt], mask_id, block_size=4, threshold=MIXED)
        assert alone.sequences[0] == batched.sequences[i]
        assert alone.steps[0] == batched.steps[i]


@pytest.mark.parametrize("threshold", [0.0, MIXED, 2.0])
def test_block_size_one_is_ar(model, prompts, mask_id, ar_ref, threshold) -> None:
    out = decode(model, prompts, mask_id, block_size=1, threshold=threshold)
    assert out.sequences == ar_ref
    assert out.nfe == NEW  # one forward per token, the prefill included, as AR
    assert out.steps == [list(range(NEW))] * len(prompts)


def test_one_token_per_forward_above_one(model, prompts, mask_id) -> None:
    out = decode(model, prompts, mask_id, block_size=4, threshold=1.5)
    assert out.nfe == NEW and out.tokens_per_forward == len(prompts)
    for steps in out.steps:
        assert sorted(steps) == list(range(NEW))


def test_whole_block_per_forward_at_zero(model, prompts, mask_id) -> None:
    for bsz in (4, 3):  # 3: the last block is cut by max_new_tokens
        out = decode(model, prompts, mask_id, block_size=bsz, threshold=0.0)
        assert out.nfe == math.ceil(NEW / bsz)
        assert all(len(s) == NEW for s in out.sequences)
        assert out.steps[0] == [i // bsz for i in range(NEW)]


def test_trace_replays_with_a_full_forward(model, prompts, mask_id) -> None:
    """Each token is the argmax at its position of one full forward over the
    tokens committed at earlier steps (others masked) with the block mask."""
    bsz = 4
    out = decode(model, prompts[:3], mask_id, block_size=bsz, threshold=MIXED)
    for prompt, seq, steps in zip(prompts[:3], out.sequences, out.steps):
        p = len(prompt)
        for t in sorted(set(steps)):
            now = [i for i, s in enumerate(steps) if s == t]
            end = (now[0] // bsz + 1) * bsz  # end of the active block
            assert all(i // bsz == now[0] // bsz for i in now)
            resp = [seq[i] if i < len(seq) and steps[i] < t else mask_id for i in range(end)]
            ids = torch.tensor([prompt + resp])
            mask = block_causal_mask(torch.ones_like(ids), p, bsz)
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(ids.shape[1])[None]).logits
            logits[..., mask_id] = float("-inf")
            pred = logits[0, p - 1 : p - 1 + end].argmax(-1)
            assert [int(pred[i]) for i in now] == [seq[i] for i in now]


def test_sampling_is_reproducible(model, prompts, mask_id) -> None:
    def sample(seed: int, use_cache: bool = True) -> DiffusionDecodeOutput:
        g = torch.Generator().manual_seed(seed)
        return decode(model, prompts, mask_id, block_size=4, threshold=0.3, temperature=1.0, generator=g,
                      eos_id=EOS, use_cache=use_cache)

    a, b, c = sample(7), sample(7), sample(8)
    assert a.sequences == b.sequences and a.steps == b.steps
    assert a.sequences != c.sequences
    assert all(mask_id not in s for s in a.sequences)
    # The same random stream drives the recompute path identically.
    assert sample(7, use_cache=False).sequences == a.sequences


def test_zero_new_tokens_and_bad_block(model, prompts, mask_id) -> None:
    out = decode(model, prompts, mask_id, block_size=4, threshold=0.5, max_new_tokens=0)
    assert out.sequences == [[] for _ in prompts] and out.nfe == 0 and out.steps == [[] for _ in prompts]
    with pytest.raises(ValueError):
        decode(model, prompts, mask_id, block_size=0, threshold=0.5)

