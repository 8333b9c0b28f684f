"""Our AR decode loop: cache vs recompute, left padding, eos, sampling, HF parity, log-probs."""

from __future__ import annotations

import pytest
import torch

from gr2model.decoding.ar_decode import DecodeOutput, ar_generate, hf_generate, left_pad

from tiny import EOS, NO_EOS, PAD

# `model` and `prompts`: the raw-id fixtures of tests/conftest.py.


def test_left_pad() -> None:
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=PAD)
    assert ids.tolist() == [[5, 6, 7], [PAD, PAD, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError):
        left_pad([[5], []], pad_id=PAD)


def test_cached_equals_uncached_greedy(model, prompts) -> None:
    cached = ar_generate(model, prompts, pad_id=PAD, eos_id=NO_EOS, max_new_tokens=20, return_logprobs=True)
    full = ar_generate(
        model, prompts, pad_id=PAD, eos_id=NO_EOS, max_new_tokens=20, use_cache=False, return_logprobs=True
    )
    assert cached.sequences == full.sequences
    assert all(len(s) == 20 for s in cached.sequences)
    assert cached.nfe == full.nfe == 20
    assert cached.generated_tokens == 20 * len(prompts)
    for a, b in zip(cached.logprobs, full.logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)


def test_left_padding_does_not_change_a_row(model, prompts) -> None:
    batched = ar_generate(model, prompts, pad_id=PAD, eos_id=NO_EOS, max_new_tokens=20)
    for prompt, seq in zip(prompts, batched.sequences):
        alone = ar_generate(model, [prompt], pad_id=PAD, eos_id=NO_EOS, max_new_tokens=20)
        assert alone.sequences[0] == seq


def test_eos_stops_each_row(model, prompts) -> None:
    ref = ar_generate(model, prompts, pad_id=PAD, eos_id=NO_EOS, max_new_tokens=20).sequences
    # Use as eos a token that the first row emits mid-way: rows stop at
    # different steps and the others must go on unchanged after it leaves.
    eos = ref[0][5]
    expected = [s[: s.index(eos) + 1] if eos in s else s for s in ref]
    assert len({len(s) for s in expected}) > 1
    for use_cache in (True, False):
        out = ar_generate(model, prompts, pad_id=PAD, eos_id=eos, max_new_tokens=20, use_cache=use_cache)
        assert out.sequences == expected
        assert out.generated_tokens == sum(len(s) for s in expected)
        assert out.nfe == max(len(s) for s in expected)


def test_all_rows_finished_stops_decoding(model, prompts) -> None:
    first = ar_generate(model, prompts[:1], pad_id=PAD, eos_id=NO_EOS, max_new_tokens=1).sequences[0][0]
    out = ar_generate(model, prompts[:1], pad_id=PAD, eos_id=first, max_new_tokens=20)
    assert out.sequences == [[first]] and out.nfe == 1 and out.generated_tokens == 1


def test_zero_new_tokens(model, prompts) -> None:
    out = ar_generate(model, prompts, pad_id=PAD, eos_id=EOS, max_new_tokens=0)
    assert out.sequences == [[] for _ in prompts] and out.nfe == 0 and out.generated_tokens == 0


def test_sampling_is_reproducible(model, prompts) -> None:
    def sample(seed: int, use_cache: bool = True) -> DecodeOutput:
        g = torch.Generator().manual_seed(seed)
        return ar_generate(
            model, prompts, pad_id=PAD, eos_id=EOS, max_new_tokens=16,
            temperature=1.0, top_k=10, generator=g, use_cache=use_cache,
        )

    a, b, c = sample(7), sample(7), sample(8)
    assert a.sequences == b.sequences
    assert a.sequences != c.sequences
    # The same random stream drives the recompute path identically.
    assert sample(7, use_cache=False).sequences == a.sequences


def streams(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_a_stream_per_row_makes_a_row_independent_of_its_batch(model, prompts) -> None:
    """What the RL stages rely on to sample the same rollouts on any number of processes."""
    kw = dict(pad_id=PAD, eos_id=EOS, max_new_tokens=16, temperature=1.0, top_k=10)
    seeds = list(range(100, 100 + len(prompts)))
    batched = ar_generate(model, prompts, generator=streams(seeds), **kw)
    assert len({len(s) for s in batched.sequences}) > 1  # rows leave the batch at different steps
    for i in range(len(prompts)):
        assert ar_generate(model, [prompts[i]], generator=streams([seeds[i]]), **kw).sequences[0] == batched.sequences[i]
    halves = ar_generate(model, prompts[1::2], generator=streams(seeds[1::2]), **kw).sequences
    assert halves == batched.sequences[1::2]
    with pytest.raises(ValueError, match="generators for"):
        ar_generate(model, prompts, generator=streams(seeds[:-1]), **kw)


def test_top_k_one_is_greedy(model, prompts) -> None:
    greedy = ar_generate(model, prompts, pad_id=PAD, eos_id=EOS, max_new_tokens=12)
    g = torch.Generator().manual_seed(0)
    top1 = ar_generate(
        model, prompts, pad_id=PAD, eos_id=EOS, max_new_tokens=12, temperature=0.8, top_k=1, generator=g
    )
    assert top1.sequences == greedy.sequences


def test_greedy_matches_hf_generate(model, prompts) -> None:
    ref = ar_generate(model, prompts, pad_id=PAD, eos_id=NO_EOS, max_new_tokens=20).sequences
    eos = ref[0][5]  # some rows stop early, as above
    ours = ar_generate(model, prompts, pad_id=PAD, eos_id=eos, max_new_tokens=20)
    hf = hf_generate(model, prompts, pad_id=PAD, eos_id=eos, max_new_tokens=20)
    assert ours.sequences == hf.sequences
    assert ours.generated_tokens == hf.generated_tokens
    assert ours.nfe == hf.nfe


def test_logprobs_match_a_full_forward(model, prompts) -> None:
    g = torch.Generator().manual_seed(3)
    # Sampled at temperature 0.7 with top-k: the log-probs must still be the
    # raw (temperature 1, full vocabulary) ones.
    out = ar_generate(
        model, prompts, pad_id=PAD, eos_id=EOS, max_new_tokens=12,
        temperature=0.7, top_k=5, generator=g, return_logprobs=True,
    )
    assert out.logprobs is not None
    for prompt, seq, lps in zip(prompts, out.sequences, out.logprobs):
        assert len(lps) == len(seq)
        ids = torch.tensor([prompt + seq])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)[0]
        # Token i of the response is predicted at position len(prompt) + i - 1.
        expected = logp[len(prompt) - 1 : len(prompt) - 1 + len(seq)].gather(-1, torch.tensor(seq)[:, None])
        assert torch.allclose(torch.tensor(lps), expected.squeeze(-1), atol=1e-4)
