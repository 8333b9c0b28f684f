"""Replay of block-diffusion decodes: the canvases by hand, the multi-copy layout, and exact
agreement with the decoder's own log-probs (ragged rows, left padding, cut tails, B = 1 is AR)."""

from __future__ import annotations

import pytest
import torch

from gr2model.decoding.ar_decode import ar_generate
from gr2model.training.cft import prediction_sources, training_attention_mask, training_position_ids
from gr2model.training.dapo import sequence_logprobs
from gr2model.decoding.diffusion_decode import diffusion_generate
from gr2model.training.diffusion_replay import (
    Trajectory,
    build_replay_batch,
    replay_columns,
    replay_logprobs,
    replay_plan,
    split_by_columns,
    trajectories_from_decode,
)
from gr2model.training.sft import IGNORE_INDEX

from tiny import PAD

# `model` and `prompts`: the raw-id fixtures of tests/conftest.py.

MASK = 4  # a token greedy AR decoding never writes with this model (B = 1 parity with AR)
NEW = 18  # not a multiple of 4: the last block has slots past max_new_tokens
# Greedy, threshold 0.2, "eos" 29 (a frequent token): rows stop at 9, 13, 18, 11, 5
# tokens, 56 tokens in 11 forwards, and 6 tokens after an eos were committed before
# it (cut tails). Asserted below, so a change of model that loses them is noticed.
THRESHOLD, STOP = 0.2, 29


def decode(model, prompts, **kw):
    args = dict(pad_id=PAD, eos_id=STOP, mask_id=MASK, block_size=4, threshold=THRESHOLD, max_new_tokens=NEW,
                return_trace=True, return_logprobs=True)
    args.update(kw)
    return diffusion_generate(model, prompts, **args)


def replay(model, trajs, block_size: int, **kw):
    with torch.no_grad():
        return replay_logprobs(model, trajs, block_size=block_size, mask_id=MASK, pad_id=PAD, **kw)


# ------------------------------------------------------------------ layout


def test_multi_copy_layout_by_hand() -> None:
    """p=1, L=2, B=2, two noisy copies: each copy sees the prompt and its own block only,
    never the other copy; one copy is cft's layout unchanged."""
    p, L = torch.tensor([1]), torch.tensor([2])
    mask = training_attention_mask(p, L, 2, copies=torch.tensor([2]))
    rows = [
        [1, 0, 0, 0, 0, 0, 0],  # P0
        [1, 1, 1, 0, 0, 0, 0],  # copy 0, block 0
        [1, 1, 1, 0, 0, 0, 0],
        [1, 0, 0, 1, 1, 0, 0],  # copy 1, block 0
        [1, 0, 0, 1, 1, 0, 0],
        [1, 0, 0, 0, 0, 1, 1],  # clean block 0
        [1, 0, 0, 0, 0, 1, 1],
    ]
    assert mask[0, 0].long().tolist() == rows
    assert training_position_ids(p, L, copies=torch.tensor([2])).tolist() == [[0, 1, 2, 1, 2, 1, 2]]
    assert prediction_sources(1, 2, 2, copy=1, copies=2).tolist() == [0, 3]
    # Two blocks of one: copy 1 block 1 reads the clean copy's block 0 (first token of a block).
    assert prediction_sources(2, 2, 1, copy=1, copies=2).tolist() == [1, 6]  # P0 P1 | 2 copies | C0 C1
    one = training_attention_mask(torch.tensor([2, 1]), torch.tensor([4, 2]), 2, copies=torch.tensor([1, 1]))
    assert torch.equal(one, training_attention_mask(torch.tensor([2, 1]), torch.tensor([4, 2]), 2))
    # Rows with different copy counts pad to the widest and keep their own layout.
    both = training_attention_mask(torch.tensor([1, 1]), torch.tensor([2, 2]), 2, copies=torch.tensor([2, 1]))
    assert torch.equal(both[0], mask[0])
    assert torch.equal(both[1, :, :5, :5], training_attention_mask(torch.tensor([1]), torch.tensor([2]), 2)[0])
    with pytest.raises(ValueError):
        prediction_sources(1, 2, 2, copy=2, copies=2)


def test_replay_rows_by_hand() -> None:
    """B=2, prompt [7, 8], response a b c d e (f: a tail token after the cut).

    block 0: a at step 1, b at step 0 -> canvases [M M] (scores b) and [M b] (scores a);
    block 1: c, d at step 2 -> one canvas [M M];
    block 2: e at step 3, f (tail) at step 2 -> the canvas of step 3 holds f: [M f].
    """
    a, b, c, d, e, f, M = 10, 11, 12, 13, 14, 15, 99
    traj = Trajectory(prompt=[7, 8], tokens=[a, b, c, d, e, f], steps=[1, 0, 2, 2, 3, 2], length=5)
    st = torch.tensor(traj.steps)
    assert replay_plan(st, torch.arange(6) < 5, 2).tolist() == [[0, 2, 3], [1, -1, -1]]
    batch = build_replay_batch([traj], block_size=2, mask_id=M, pad_id=0, max_copies=0)
    # [prompt | copy 0 | copy 1 | clean]; a block with no j-th step is all masks in copy j.
    assert batch["input_ids"].tolist() == [
        [7, 8, M, M, M, M, M, f, M, b, M, M, M, M, a, b, c, d, e, f]
    ]
    assert batch["copies"].tolist() == [2]
    tgt = {col: int(t) for col, t in enumerate(batch["targets"][0]) if t != IGNORE_INDEX}
    # a: s=0 <- last prompt column; b: copy 0 col of a; c: first of block 1 <- clean b
    # (col 2 + 2*6 + 1); d <- copy 0 col of c; e: first of block 2 <- clean d.
    assert tgt == {1: a, 2: b, 15: c, 4: d, 17: e}
    assert {int(batch["target_pos"][0, col]): t for col, t in tgt.items()} == {0: a, 1: b, 2: c, 3: d, 4: e}
    assert (batch["target_traj"][0][batch["targets"][0] != IGNORE_INDEX] == 0).all()

    # Scoring the tail: block 2 now has two steps, 2 (f) then 3 (e, on the canvas [M f]).
    tail = build_replay_batch([traj], block_size=2, mask_id=M, pad_id=0, max_copies=0, include_tail=True)
    assert tail["input_ids"].tolist() == [
        [7, 8, M, M, M, M, M, M, M, b, M, M, M, f, a, b, c, d, e, f]
    ]
    tgt = {col: int(t) for col, t in enumerate(tail["targets"][0]) if t != IGNORE_INDEX}
    assert tgt == {1: a, 2: b, 15: c, 4: d, 6: f, 17: e}

    # One canvas per row: cft's layout as is, two rows of p + 2L.
    rows = build_replay_batch([traj], block_size=2, mask_id=M, pad_id=0, max_copies=1)
    assert rows["input_ids"].tolist() == [
        [7, 8, M, M, M, M, M, f, a, b, c, d, e, f],
        [7, 8, M, b, M, M, M, M, a, b, c, d, e, f],
    ]
    assert sorted(int(t) for t in rows["targets"][rows["targets"] != IGNORE_INDEX]) == [a, b, c, d, e]


def test_trajectory_checks() -> None:
    with pytest.raises(ValueError):
        Trajectory(prompt=[1], tokens=[5, 6], steps=[0], length=2)
    with pytest.raises(ValueError):
        Trajectory(prompt=[1], tokens=[5, 6], steps=[0, -1], length=2)  # a sequence token never committed
    with pytest.raises(ValueError):
        Trajectory(prompt=[], tokens=[5], steps=[0], length=1)
    with pytest.raises(ValueError):
        build_replay_batch([Trajectory(prompt=[1], tokens=[], steps=[], length=0)], block_size=2, mask_id=3, pad_id=0)


# -------------------------------------------------------- agreement with the decoder


def test_decoder_logprobs_cached_equals_recompute(model, prompts) -> None:
    outs = [decode(model, prompts, use_cache=c) for c in (True, False)]
    assert outs[0].sequences == outs[1].sequences and outs[0].tail_tokens == outs[1].tail_tokens
    assert outs[0].tail_steps == outs[1].tail_steps
    for a, b in zip(outs[0].logprobs + outs[0].tail_logprobs, outs[1].logprobs + outs[1].tail_logprobs):
        assert a == pytest.approx(b, abs=1e-5)
    out = outs[0]
    # What this configuration is chosen for (see THRESHOLD, STOP).
    assert len({len(s) for s in out.sequences}) > 1
    assert out.nfe < out.generated_tokens / 2  # several tokens per forward
    assert sum(s >= 0 for ts in out.tail_steps for s in ts) > 0  # committed tails
    for seq, tail, tail_steps in zip(out.sequences, out.tail_tokens, out.tail_steps):
        assert (len(seq) + len(tail)) % 4 == 0 or len(seq) == NEW  # the rest of the last block
        assert all((t == MASK) == (s < 0) for t, s in zip(tail, tail_steps))


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("max_copies", [1, 2, 0])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_replay_equals_the_decode(model, prompts, block_size, batch, max_copies, temperature) -> None:
    """Every committed token (cut tails included), replayed under the same weights, has the
    log-prob the decoder computed when it committed it."""
    rows = prompts[:batch] if batch > 1 else prompts[3:4]
    out = decode(model, rows, block_size=block_size, temperature=temperature,
                 generator=torch.Generator().manual_seed(0))
    trajs = trajectories_from_decode(rows, out)
    logp, mask = replay(model, trajs, block_size, include_tail=True, max_copies=max_copies)
    for i, t in enumerate(trajs):
        scored = [j for j, s in enumerate(t.steps) if s >= 0]
        assert mask[i].nonzero().squeeze(-1).tolist() == scored
        torch.testing.assert_close(logp[i, scored], torch.tensor([t.logprobs[j] for j in scored]), atol=1e-5, rtol=0)
    # Without the tail: the sequence only, the same values.
    seq_lp, seq_mask = replay(model, trajs, block_size, max_copies=max_copies)
    for i, t in enumerate(trajs):
        assert seq_mask[i].tolist() == [1.0] * t.length + [0.0] * (seq_mask.shape[1] - t.length)
        torch.testing.assert_close(seq_lp[i, : t.length], logp[i, : t.length], atol=1e-6, rtol=0)
    # Fewer canvases than forwards: the replay does not cost one row per step.
    canvases = build_replay_batch(trajs, block_size=block_size, mask_id=MASK, pad_id=PAD, include_tail=True,
                                  max_copies=1)
    assert canvases["input_ids"].shape[0] <= block_size * len(trajs)


@pytest.mark.parametrize("block_size, sub_block_size", [(4, 2), (8, 2), (8, 4)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_replay_equals_a_sub_block_decode(model, prompts, block_size, sub_block_size, temperature) -> None:
    """Sub-block decoding changes which positions a step commits, not what it sees: the
    unchanged replay (block canvases) gives the decoder's log-probs, tails included."""
    out = decode(model, prompts, block_size=block_size, sub_block_size=sub_block_size, temperature=temperature,
                 generator=torch.Generator().manual_seed(0))
    trajs = trajectories_from_decode(prompts, out)
    logp, mask = replay(model, trajs, block_size, include_tail=True, max_copies=2)
    for i, t in enumerate(trajs):
        scored = [j for j, s in enumerate(t.steps) if s >= 0]
        assert mask[i].nonzero().squeeze(-1).tolist() == scored
        torch.testing.assert_close(logp[i, scored], torch.tensor([t.logprobs[j] for j in scored]), atol=1e-5, rtol=0)


def test_block_size_one_is_ar(model, prompts) -> None:
    """B=1: the decoder's log-probs are ar_generate's, and the replay is sequence_logprobs."""
    out = decode(model, prompts, block_size=1, eos_id=-1)
    ar = ar_generate(model, prompts, pad_id=PAD, eos_id=-1, max_new_tokens=NEW, return_logprobs=True)
    assert out.sequences == ar.sequences
    for a, b in zip(out.logprobs, ar.logprobs):
        assert a == pytest.approx(b, abs=1e-5)
    trajs = trajectories_from_decode(prompts, out)
    logp, mask = replay(model, trajs, 1)
    with torch.no_grad():
        ref, ref_mask = sequence_logprobs(model, prompts, out.sequences, PAD)
    assert torch.equal(mask, ref_mask)
    torch.testing.assert_close(logp, ref, atol=1e-5, rtol=0)
    batch = build_replay_batch(trajs, block_size=1, mask_id=MASK, pad_id=PAD)
    assert batch["copies"].tolist() == [1] * len(prompts)  # one canvas: every token from the clean copy


def test_replay_has_gradients(model, prompts) -> None:
    out = decode(model, prompts[:3], temperature=1.0, generator=torch.Generator().manual_seed(1))
    trajs = trajectories_from_decode(prompts[:3], out)
    logp, mask = replay_logprobs(model, trajs, block_size=4, mask_id=MASK, pad_id=PAD)
    (logp * mask).sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    model.zero_grad(set_to_none=True)


def test_replay_columns_and_parts(model, prompts) -> None:
    out = decode(model, prompts)
    trajs = trajectories_from_decode(prompts, out)
    for include_tail in (False, True):
        for max_copies in (1, 3, 0):
            kw = dict(block_size=4, include_tail=include_tail, max_copies=max_copies)
            widths = [replay_columns(t, **kw) for t in trajs]
            for t, w in zip(trajs, widths):
                batch = build_replay_batch([t], mask_id=MASK, pad_id=PAD, **kw)
                assert int(batch["n_tokens"]) == w
    assert split_by_columns([5, 3, 4, 9, 1], 8) == [[0, 1], [2], [3], [4]]  # 9 > 8: a part of its own
    assert split_by_columns([5, 3], 0) == [[0, 1]] and split_by_columns([], 8) == []
