"""Block-diffusion decoding: commit rule, cache vs recompute, B = 1 is AR, NFE bounds, trace replay."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from gr2model.decoding.ar_decode import ar_generate
from gr2model.models.block_diffusion import block_causal_mask
import gr2model.decoding.diffusion_decode as dd
from gr2model.decoding.diffusion_decode import DiffusionDecodeOutput, commit_mask, diffusion_generate, propose

from tiny import EOS, NO_EOS, PAD, VOCAB

# `model` and `prompts`: the raw-id fixtures of tests/conftest.py.
NEW = 20
# On this random model the top probabilities are mostly 0.05-0.4: 0.3 commits
# several tokens in some steps and one in others, and rows progress unevenly
# (every kind of cached step occurs, see test_cached_equals_recompute).
MIXED = 0.3


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
    call = dd.CachedForward.__call__

    def spy(self, resp, start, plen, ctx, ctx_list, win=None):
        # No sub-blocks: the whole-block logits path, but for a lone greedy row's open positions.
        assert win is None or resp.shape[0] == 1
        ragged = min(self.kept) != max(self.kept)
        if ctx is None:
            kinds.add("prefill")
        elif not any(ctx_list):
            kinds.add("denoise ragged" if ragged else "denoise")
        else:
            kinds.add("finish some" if ragged or not all(ctx_list) else "finish all")
        return call(self, resp, start, plen, ctx, ctx_list, win)

    monkeypatch.setattr(dd.CachedForward, "__call__", spy)
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



# ---------------------------------------------------------------- sub-blocks


class RisingConfidence(torch.nn.Module):
    """A fake model whose confidences the test controls: the column at position id q
    proposes token 3 + (q + 1) % 30 with logit 0.2 q (every other logit 0), so the
    confidence of a proposal grows with its position. Without sub-blocks, one token
    per step means right to left in each block; with them, left to right by sub-block."""

    def __init__(self) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # the decoder reads its device
        self.config = type("Config", (), {"num_hidden_layers": 1})()

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep, **_):
        from transformers.modeling_utils import slice_logits_to_keep

        q = position_ids.float()
        logits = torch.zeros((*input_ids.shape, VOCAB))
        logits.scatter_(-1, (3 + (position_ids + 1) % 30)[..., None], 0.2 * q[..., None])
        return type("Out", (), {"logits": slice_logits_to_keep(logits, logits_to_keep)})()


def fake_decode(prompts, **kw) -> DiffusionDecodeOutput:
    args = dict(pad_id=PAD, eos_id=NO_EOS, mask_id=VOCAB - 1, max_new_tokens=16, return_trace=True)
    args.update(kw)
    return diffusion_generate(RisingConfidence(), prompts, **args)


@pytest.mark.parametrize("use_cache", [True, False])
def test_sub_blocks_commit_left_to_right_by_hand(prompts, use_cache) -> None:
    one = dict(block_size=8, threshold=2.0, use_cache=use_cache)  # one token per step
    # Whole blocks: the most confident (rightmost) masked position first.
    whole = fake_decode(prompts, **one).steps
    assert whole == [[8 * (i // 8) + 7 - i % 8 for i in range(16)]] * len(prompts)
    # Sub-blocks of 4: right to left inside a sub-block, sub-blocks left to right.
    sub = fake_decode(prompts, **one, sub_block_size=4).steps
    assert sub == [[4 * (i // 4) + 3 - i % 4 for i in range(16)]] * len(prompts)
    # Threshold 0: a whole window per step, so one forward per sub-block.
    for s in (8, 4, 2, 1):
        out = fake_decode(prompts, block_size=8, threshold=0.0, use_cache=use_cache, sub_block_size=s)
        assert out.steps == [[i // s for i in range(16)]] * len(prompts)
        assert out.nfe == 16 // s


def test_sub_block_none_and_whole_block_are_the_old_decoder(model, prompts, mask_id) -> None:
    """None takes the old path; S = B takes the sub-block path with one window per block:
    both give the tokens, steps, NFE and log-probs of the decoder without the argument
    (ragged rows with eos, sampling, tails)."""
    ref = decode(model, prompts, mask_id, block_size=4, threshold=MIXED).sequences
    eos = ref[0][5]
    for kw in (dict(threshold=MIXED, eos_id=eos),
               dict(threshold=0.3, eos_id=EOS, temperature=1.0)):
        def run(**sub):
            g = torch.Generator().manual_seed(3)
            return decode(model, prompts, mask_id, block_size=4, generator=g, return_logprobs=True, **kw, **sub)

        old, none, whole = run(), run(sub_block_size=None), run(sub_block_size=4)
        for out in (none, whole):
            assert out.sequences == old.sequences and out.steps == old.steps and out.nfe == old.nfe
            assert out.tail_tokens == old.tail_tokens and out.tail_steps == old.tail_steps
            assert out.logprobs == old.logprobs and out.tail_logprobs == old.tail_logprobs


def sub_block_order_holds(steps: list[int], bsz: int, sub: int) -> bool:
    """In every block, each step's commits lie in one sub-block and every sub-block is
    finished before the next one starts (steps -1: never committed, ignored)."""
    for b0 in range(0, len(steps), bsz):
        spans = []
        for s0 in range(b0, min(b0 + bsz, len(steps)), sub):
            done = [t for t in steps[s0 : s0 + sub] if t >= 0]
            if done:
                spans.append((min(done), max(done)))
        if any(hi >= lo for (_, hi), (lo, _) in zip(spans, spans[1:])):
            return False
    return True


@pytest.mark.parametrize("sub", [None, 4])
def test_a_lone_greedy_row_computes_only_its_open_positions(model, prompts, mask_id, sub, monkeypatch) -> None:
    """Alone, a greedy row's steps keep the logits of its open positions only; it decodes as in a batch."""
    widths: list[int] = []
    call = dd.CachedForward.__call__

    def spy(self, resp, start, plen, ctx, ctx_list, win=None):
        widths.append(self.block_size if win is None else win.shape[1])
        return call(self, resp, start, plen, ctx, ctx_list, win)

    monkeypatch.setattr(dd.CachedForward, "__call__", spy)
    kw = dict(block_size=8, threshold=MIXED, sub_block_size=sub, return_logprobs=True)
    prompt = prompts[1]
    alone = decode(model, [prompt], mask_id, **kw)
    assert min(widths) < (sub or 8) and max(widths) == (sub or 8)  # narrower once positions are committed
    # Two copies of the row: a batch, whole windows (and the masked forwards of a batch).
    pair = decode(model, [prompt, prompt], mask_id, **kw)
    assert pair.sequences == [alone.sequences[0]] * 2 and pair.steps == [alone.steps[0]] * 2
    assert pair.logprobs[0] == pytest.approx(alone.logprobs[0], abs=1e-5)


@pytest.mark.parametrize("block_size, sub", [(4, 2), (8, 4), (8, 2)])
def test_sub_blocks_cached_equals_recompute(model, prompts, mask_id, block_size, sub, monkeypatch) -> None:
    # Record the kinds of cached forward, and whether a row mid-block sat in a later
    # sub-block while others started a block (the per-row logits offset of that forward).
    kinds: set[str] = set()
    call = dd.CachedForward.__call__

    def spy(self, resp, start, plen, ctx, ctx_list, win=None):
        if ctx is not None and any(ctx_list) and not all(ctx_list) and bool((win[:, 0] > 0).any()):
            kinds.add("finish some, later sub-block")
        elif ctx is not None and not any(ctx_list) and bool((win[:, 0] > 0).any()):
            kinds.add("denoise, later sub-block")
        return call(self, resp, start, plen, ctx, ctx_list, win)

    monkeypatch.setattr(dd.CachedForward, "__call__", spy)
    ref = decode(model, prompts, mask_id, block_size=block_size, threshold=0.2, sub_block_size=sub).sequences
    eos = ref[1][7]  # rows stop at different steps
    outs = [decode(model, prompts, mask_id, block_size=block_size, threshold=0.2, sub_block_size=sub, eos_id=eos,
                   use_cache=c, return_logprobs=True) for c in (True, False)]
    cached, full = outs
    assert cached.sequences == full.sequences and cached.steps == full.steps and cached.nfe == full.nfe
    assert cached.tail_steps == full.tail_steps
    for a, b in zip(cached.logprobs, full.logprobs):
        assert a == pytest.approx(b, abs=1e-5)
    assert len({len(s) for s in cached.sequences}) > 1
    assert cached.nfe < cached.generated_tokens  # some steps commit several tokens
    assert kinds == {"finish some, later sub-block", "denoise, later sub-block"}
    for steps, tail in zip(cached.steps, cached.tail_steps):
        assert sub_block_order_holds(steps + tail, block_size, sub)
    for seq in cached.sequences:
        assert eos not in seq[:-1] and (seq[-1] == eos or len(seq) == NEW)


@pytest.mark.parametrize("threshold", [0.2, MIXED, 2.0])
def test_sub_blocks_commit_only_in_the_current_sub_block(model, prompts, mask_id, threshold) -> None:
    out = decode(model, prompts, mask_id, block_size=8, threshold=threshold, sub_block_size=2)
    for steps in out.steps:
        assert sub_block_order_holds(steps, 8, 2)
    # The same setting without sub-blocks does not follow that order (so the check means something).
    free = decode(model, prompts, mask_id, block_size=8, threshold=threshold)
    assert not all(sub_block_order_holds(steps, 8, 2) for steps in free.steps)


def test_sub_block_trace_replays_with_a_full_forward(model, prompts, mask_id) -> None:
    """As test_trace_replays_with_a_full_forward: a sub-block step sees its whole block."""
    bsz = 8
    out = decode(model, prompts[:3], mask_id, block_size=bsz, threshold=0.2, sub_block_size=4)
    for prompt, seq, steps in zip(prompts[:3], out.sequences, out.steps):
        p = len(prompt)
        for t in sorted(set(steps)):
            now = [i for i, s in enumerate(steps) if s == t]
            end = (now[0] // bsz + 1) * bsz
            resp = [seq[i] if i < len(seq) and steps[i] < t else mask_id for i in range(end)]
            ids = torch.tensor([prompt + resp])
            mask = block_causal_mask(torch.ones_like(ids), p, bsz)
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(ids.shape[1])[None]).logits
            logits[..., mask_id] = float("-inf")
            pred = logits[0, p - 1 : p - 1 + end].argmax(-1)
            assert [int(pred[i]) for i in now] == [seq[i] for i in now]


def test_sub_blocks_batch_equals_rows_alone(model, prompts, mask_id) -> None:
    ref = decode(model, prompts, mask_id, block_size=8, threshold=0.2, sub_block_size=4).sequences
    eos = ref[1][7]
    kw = dict(block_size=8, threshold=0.2, sub_block_size=4, eos_id=eos, return_logprobs=True)
    batched = decode(model, prompts, mask_id, **kw)
    assert len({len(s) for s in batched.sequences}) > 1  # ragged: rows finish at different steps
    for i, prompt in enumerate(prompts):
        alone = decode(model, [prompt], mask_id, **kw)
        assert alone.sequences[0] == batched.sequences[i]
        assert alone.steps[0] == batched.steps[i] and alone.tail_steps[0] == batched.tail_steps[i]
        assert alone.logprobs[0] == pytest.approx(batched.logprobs[i], abs=1e-5)


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_stream_per_row_makes_a_row_independent_of_its_batch(model, prompts, mask_id, use_cache) -> None:
    """Sampled with one stream per row, a row commits the same tokens at the same steps
    alone as in a batch whose other rows take more forwards (RL on several processes)."""
    def streams(rows: list[int]) -> list[torch.Generator]:
        return [torch.Generator().manual_seed(100 + i) for i in rows]

    kw = dict(block_size=4, threshold=0.3, temperature=1.0, eos_id=EOS, sub_block_size=2, use_cache=use_cache)
    batched = decode(model, prompts, mask_id, generator=streams(list(range(len(prompts)))), **kw)
    assert len({max(s, default=-1) for s in batched.steps}) > 1  # rows take different numbers of forwards
    for i, prompt in enumerate(prompts):
        alone = decode(model, [prompt], mask_id, generator=streams([i]), **kw)
        assert alone.sequences[0] == batched.sequences[i] and alone.steps[0] == batched.steps[i]


@pytest.mark.parametrize("sub", [0, -2, 3, 16])
def test_bad_sub_block_size(model, prompts, mask_id, sub) -> None:
    with pytest.raises(ValueError, match=f"block_size 8, got {sub}"):
        decode(model, prompts, mask_id, block_size=8, threshold=0.5, sub_block_size=sub)
    with pytest.raises(ValueError):
        dd.check_sub_block_size(8, sub)
    dd.check_sub_block_size(8, None)


# ------------------------------------------------------- the sub-block cache


def window_forward_logits(model, prompt, canvas_then, canvas_now, block, q0, queries, bsz):
    """(queries, V) logits of a sub-block step with the sub-block cache, built independently.

    The keys/values of one full forward over `canvas_then` (the step that last covered the
    block whole, block mask), less the columns of the `queries` positions [q0, q0 + queries)
    of block `block`; those positions recomputed from `canvas_now`, attending all of it.
    Attention does not care where a key sits in the cache: its position is in its rotation.
    """
    p = len(prompt)
    end = (block + 1) * bsz
    ids = torch.tensor([prompt + canvas_then[:end]])
    full_mask = block_causal_mask(torch.ones_like(ids), p, bsz)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, attention_mask=full_mask, position_ids=torch.arange(ids.shape[1])[None], cache=cache, use_cache=True)
    lo = p + block * bsz + q0
    keep = [c for c in range(ids.shape[1]) if not lo <= c < lo + queries]
    window = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        window.update(layer.keys[:, :, keep], layer.values[:, :, keep], i)
    x = torch.tensor([canvas_now[block * bsz + q0 : block * bsz + q0 + queries]])
    mask = torch.ones((1, 1, queries, len(keep) + queries), dtype=torch.bool)
    out = model(input_ids=x, attention_mask=mask, position_ids=torch.arange(lo, lo + queries)[None], cache=window, use_cache=True)
    return out.logits[0]


def test_sub_block_cache_steps_are_the_documented_approximation(model, prompts, mask_id) -> None:
    """Every token of a decode with the sub-block cache (one per step) is the argmax of the
    forward the docstring describes: the sub-block's first step a full forward, its later steps
    the sub-block (and the position before it) over the keys/values of that full forward."""
    bsz, sub = 8, 4
    out = decode(model, prompts[:2], mask_id, block_size=bsz, threshold=2.0, sub_block_size=sub, sub_block_cache=True)
    exact = decode(model, prompts[:2], mask_id, block_size=bsz, threshold=2.0, sub_block_size=sub)
    assert out.sequences != exact.sequences  # the approximation changes tokens here (so the check means something)
    windows = 0
    for prompt, seq, steps in zip(prompts[:2], out.sequences, out.steps):
        p = len(prompt)

        def canvas(t: int) -> list[int]:
            return [seq[i] if i < len(seq) and steps[i] < t else mask_id for i in range(NEW + bsz)]

        for t in sorted(set(steps)):
            (i,) = [j for j, s in enumerate(steps) if s == t]  # one token per step
            block, off = i // bsz, i % bsz // sub * sub
            first = min(s for j, s in enumerate(steps) if j // bsz == block and j % bsz // sub * sub == off)
            with torch.no_grad():
                if t == first or i % bsz == 0:  # a full forward (or the kept position-0 logits of one)
                    then = canvas(first)
                    end = (block + 1) * bsz
                    ids = torch.tensor([prompt + then[:end]])
                    mask = block_causal_mask(torch.ones_like(ids), p, bsz)
                    logits = model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(ids.shape[1])[None]).logits[0]
                    row = logits[p - 1 + i]
                else:
                    windows += 1
                    q0 = max(off - 1, 0)
                    logits = window_forward_logits(model, prompt, canvas(first), canvas(t), block, q0, sub + 1, bsz)
                    row = logits[i % bsz - 1 - q0]
            row[mask_id] = float("-inf")
            assert int(row.argmax()) == seq[i], (t, i)
    assert windows > 10


@pytest.mark.parametrize("threshold", [MIXED, 2.0])
def test_sub_block_cache_batch_equals_rows_alone(model, prompts, mask_id, threshold) -> None:
    """A row's tokens do not depend on the rows beside it: ragged rows, finished blocks
    beside sub-block steps, and rows that refresh beside rows that do not."""
    ref = decode(model, prompts, mask_id, block_size=8, threshold=threshold, sub_block_size=4, sub_block_cache=True).sequences
    eos = ref[1][7]
    kw = dict(block_size=8, threshold=threshold, sub_block_size=4, eos_id=eos, return_logprobs=True, sub_block_cache=True)
    batched = decode(model, prompts, mask_id, **kw)
    assert len({len(s) for s in batched.sequences}) > 1
    for i, prompt in enumerate(prompts):
        alone = decode(model, [prompt], mask_id, **kw)
        assert alone.sequences[0] == batched.sequences[i] and alone.steps[0] == batched.steps[i]
        assert alone.logprobs[0] == pytest.approx(batched.logprobs[i], abs=1e-5)


def test_sub_block_cache_forward_widths(model, prompts, mask_id, monkeypatch) -> None:
    """One token per step, alone: a sub-block's later steps forward S + 1 positions, and a
    sub-block's first step the whole block; whole blocks (S = B) never take the cache."""
    widths: list[int] = []
    run = dd.CachedForward._run

    def spy(self, input_ids, mask, pos, keep):
        widths.append(input_ids.shape[1])
        return run(self, input_ids, mask, pos, keep)

    monkeypatch.setattr(dd.CachedForward, "_run", spy)
    bsz, sub = 8, 4
    out = decode(model, prompts[:1], mask_id, block_size=bsz, threshold=2.0, sub_block_size=sub, sub_block_cache=True)
    n_sub = NEW // sub  # 20 new tokens: 5 sub-blocks (the last block's second sub-block is past the limit)
    # The prefill, then per sub-block one whole-block forward (a finished block's forward
    # carries 2B) and S - 1 sub-block forwards.
    assert widths[0] == len(prompts[0]) + bsz
    assert sorted(set(widths[1:])) == [sub + 1, bsz, 2 * bsz]
    assert widths.count(sub + 1) == n_sub * (sub - 1) and len(widths) == out.nfe == NEW
    widths.clear()
    whole = decode(model, prompts[:1], mask_id, block_size=bsz, threshold=2.0, sub_block_size=bsz, sub_block_cache=True)
    assert sub + 1 not in widths
    assert whole.sequences == decode(model, prompts[:1], mask_id, block_size=bsz, threshold=2.0).sequences


def test_sub_block_cache_needs_the_cache(model, prompts, mask_id) -> None:
    with pytest.raises(ValueError, match="use_cache"):
        decode(model, prompts[:1], mask_id, block_size=8, threshold=0.5, sub_block_size=4, sub_block_cache=True, use_cache=False)


def test_benchmark_has_sub_block_rows() -> None:
    import polars as pl

    from gr2model.eval.bench import decode_benchmark, speed_table
    from gr2model.models.block_diffusion import convert_to_block_diffusion
    from gr2model.task.rerank_format import FormatConfig
    from gr2model.eval.rerank_eval import decoder_kwargs

    from tiny import TOY_CANDIDATES, toy_items, toy_model, toy_tokenizer

    tok = toy_tokenizer()
    ar = toy_model(tok).eval()
    dgr2 = convert_to_block_diffusion(ar, tok, block_size=4).eval()
    lists = pl.DataFrame({"history": [[], [1]], "candidates": [list(c) for c in TOY_CANDIDATES[:2]], "target": [1, 2]})
    args = dict(taus=[0.9], batch_sizes=[2], max_new_tokens=8)
    fmt = FormatConfig(history_len=1, with_attributes=False)
    plain = decode_benchmark(ar, {"d": dgr2}, tok, lists, toy_items(), fmt, **args)
    assert [(r["decoder"], r["sub_block_size"]) for r in plain] == [("ar", None), ("hf", None), ("diffusion", None)]
    assert "sub_block_size" not in speed_table(plain)
    rows = decode_benchmark(ar, {"d": dgr2}, tok, lists, toy_items(), fmt, sub_block_sizes=[2, 3], **args)
    # 3 does not divide the block size 4: skipped; 2 adds one row per threshold.
    assert [(r["decoder"], r["sub_block_size"]) for r in rows] == [
        ("ar", None), ("hf", None), ("diffusion", None), ("diffusion", 2)
    ]
    assert rows[3]["tokens_per_forward"] > 0 and rows[3]["speedup"] == rows[3]["speedup"]  # measured, not NaN
    # Against our AR loop: its own row is 1; speed = tokens per forward / cost of a forward.
    assert rows[0]["forward_cost"] == 1.0 and rows[0]["projected_speedup"] == 1.0
    for r in rows[2:]:
        assert r["forward_cost"] > 0
        assert r["projected_speedup"] == pytest.approx(r["tokens_per_forward"] / rows[0]["tokens_per_forward"])
        # Timed over three interleaved passes (the default): the median lies within their spread, and
        # the speed-up is time per example (a decoder's shorter responses earn it nothing).
        assert r["repeats"] == 3 and r["seconds_min"] <= r["seconds"] <= r["seconds_max"]
        best_ar = min(x["seconds_per_example"] for x in rows[:2])
        assert r["speedup"] == pytest.approx(best_ar * r["n"] / r["seconds"])
    assert "| forward_cost | projected_speedup |" in speed_table(rows)
    assert "| sub_block_size |" in speed_table(rows)
    with pytest.raises(ValueError):
        decode_benchmark(ar, {"d": dgr2}, tok, lists, toy_items(), fmt, sub_block_sizes=[0], **args)
    # The sub-block cache: one more row for each listed S below the block (S 4 is the block: none).
    cached = decode_benchmark(ar, {"d": dgr2}, tok, lists, toy_items(), fmt, sub_block_sizes=[4, 2], sub_block_cache_sizes=[4, 2], **args)
    assert [(r["sub_block_size"], r["sub_block_cache"]) for r in cached if r["decoder"] == "diffusion"] == [
        (None, False), (4, False), (2, False), (2, True)
    ]
    assert cached[0]["sub_block_cache"] is None and "| sub_block_cache |" in speed_table(cached)
    assert "sub_block_cache" not in speed_table(rows)
    with pytest.raises(ValueError, match="among sub_block_sizes"):
        decode_benchmark(ar, {"d": dgr2}, tok, lists, toy_items(), fmt, sub_block_sizes=[2], sub_block_cache_sizes=[4], **args)
    assert decoder_kwargs(dgr2, 0.9, sub_block_size=2, sub_block_cache=True)["sub_block_cache"] is True
    assert "sub_block_cache" not in decoder_kwargs(dgr2, 0.9, sub_block_size=2)
    # Under the grammar, explanation rows: below tau always; at tau only with sub-blocks whose
    # explanation size differs (whole blocks after S 2). The answer's tokens are the plain S 2 row's.
    k = len(TOY_CANDIDATES[0])
    index_fmt = FormatConfig(history_len=1, with_attributes=False, answer="index", answer_first=True)
    expl = decode_benchmark(
        ar, {"d": dgr2}, tok, lists, toy_items(), index_fmt, taus=[0.9], batch_sizes=[2], max_new_tokens=4 * k + 16,
        sub_block_sizes=[2], constrained=True, explanation_taus=[0.9, 0.5], explanation_sub_block_size=4,
    )  # fmt: skip
    settings = [(r["sub_block_size"], r["explanation_tau"], r["explanation_sub_block_size"]) for r in expl if r["decoder"] == "diffusion"]
    assert settings == [(None, None, None), (None, 0.5, 4), (2, None, None), (2, 0.9, 4), (2, 0.5, 4)]
    # The evaluation's decoder kwargs carry S only when set, and check it against the block size.
    assert "sub_block_size" not in decoder_kwargs(dgr2, 0.9)
    assert decoder_kwargs(dgr2, 0.9, sub_block_size=2)["sub_block_size"] == 2
    assert decoder_kwargs(ar, 0.9, sub_block_size=2) == {}
    with pytest.raises(ValueError):
        decoder_kwargs(dgr2, 0.9, sub_block_size=3)
