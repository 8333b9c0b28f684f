"""Speculative decoding: greedy equals AR, the sampling rule's distribution, rollback, counts, edge cases."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

import gr2model.decoding.speculative as sp
from gr2model.decoding.ar_decode import ar_generate
from gr2model.models.ar_model import build_ar_model
from gr2model.decoding.speculative import (
    Draft,
    DiffusionDrafter,
    SpeculativeDecodeOutput,
    WindowDrafter,
    accept_greedy,
    accept_sampling,
    sampling_probs,
    speculative_benchmark,
    speculative_generate,
)

from tiny import DECODER, EOS, PAD, VOCAB, random_ids, random_model, randomize

NO_EOS = -1  # an id no token has: rows run to max_new_tokens
NEW = 20


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return random_model().eval()


@pytest.fixture(scope="module")
def bad_model() -> torch.nn.Module:
    # Another random network: a drafter whose proposals the verifier mostly rejects.
    return randomize(build_ar_model(DECODER, VOCAB, pad_id=PAD, bos_id=1, eos_id=EOS, seed=5), 0.3, seed=5).eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_ids()  # lengths 3, 11, 1, 7, 16: ragged


@pytest.fixture(scope="module")
def ar_ref(model, prompts) -> list[list[int]]:
    return ar_generate(model, prompts, pad_id=PAD, eos_id=NO_EOS, max_new_tokens=NEW).sequences


@pytest.fixture(scope="module")
def mask_id(ar_ref) -> int:
    # A token greedy AR never emits here, so the drafter (which never drafts
    # the mask token) can still be perfect where it is the same network.
    used = {t for s in ar_ref for t in s}
    return min(set(range(3, VOCAB)) - used)


@pytest.fixture(scope="module")
def eos(ar_ref) -> int:
    # A token that row 0 emits mid-way: rows stop at different rounds.
    return ar_ref[0][5]


def cut(seqs: list[list[int]], eos: int) -> list[list[int]]:
    return [s[: s.index(eos) + 1] if eos in s else s for s in seqs]


# ---------------------------------------------------------------- test drafters


class PerfectDrafter:
    """Drafts the verifier's own greedy continuation (recomputed from scratch each round): every draft is accepted."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.nfe = model, 0

    def begin(self, ids, attention_mask, max_new_tokens, vocab_size) -> None:
        self.prompts = [row[m.bool()].tolist() for row, m in zip(ids, attention_mask)]
        self.vocab, self.nfe = vocab_size, 0

    def select(self, alive) -> None:
        self.prompts = [self.prompts[i] for i in alive.tolist()]

    def draft(self, response, length, count, temperature, generator) -> Draft:
        k = int(count.max())
        tokens = torch.zeros((len(self.prompts), k), dtype=torch.long)
        for r, (p, n, c) in enumerate(zip(self.prompts, length.tolist(), count.tolist())):
            if c:
                context = [p + response[r, :n].tolist()]
                out = ar_generate(self.model, context, pad_id=PAD, eos_id=NO_EOS, max_new_tokens=c)
                tokens[r, :c] = torch.tensor(out.sequences[0])
                self.nfe += out.nfe
        probs = torch.nn.functional.one_hot(tokens, self.vocab).float() if temperature > 0 else None
        return Draft(tokens, count.clone(), probs)


class RandomDrafter:
    """Uniform random tokens (q uniform): accepted about 1 time in VOCAB."""

    def __init__(self, seed: int = 0) -> None:
        self.g, self.nfe = torch.Generator().manual_seed(seed), 0

    def begin(self, ids, attention_mask, max_new_tokens, vocab_size) -> None:
        self.vocab = vocab_size

    def select(self, alive) -> None:
        pass

    def draft(self, response, length, count, temperature, generator) -> Draft:
        k = int(count.max())
        tokens = torch.randint(0, self.vocab, (length.shape[0], k), generator=self.g)
        probs = torch.full((length.shape[0], k, self.vocab), 1.0 / self.vocab) if temperature > 0 else None
        return Draft(tokens, count.clone(), probs)


def spec(model, drafter, prompts, **kw) -> SpeculativeDecodeOutput:
    args = dict(pad_id=PAD, eos_id=NO_EOS, max_new_tokens=NEW, draft_len=4)
    args.update(kw)
    return speculative_generate(model, drafter, prompts, **args)


def check_counts(out: SpeculativeDecodeOutput, batch: int) -> None:
    assert out.generated_tokens == sum(len(s) for s in out.sequences)
    assert out.nfe == out.ar_nfe + out.draft_nfe
    assert len(out.accepted_lengths) == batch
    # Every verification of a row adds its accepted drafts plus one AR token (before an eos cut).
    for seq, acc in zip(out.sequences, out.accepted_lengths):
        assert len(seq) <= sum(acc) + len(acc)
        assert len(acc) >= 1 or not seq
    assert out.accepted_tokens <= out.drafted_tokens
    assert out.verifications <= out.ar_nfe <= out.verifications + 1  # + the prefill


# ---------------------------------------------------------------- greedy equals AR


def drafters(model, bad_model, mask_id) -> dict[str, object]:
    return {
        "diffusion k=1": (DiffusionDrafter(model, 1, block_size=4, mask_id=mask_id), 1),
        "diffusion k=B=4, 2 steps": (DiffusionDrafter(model, 2, block_size=4, mask_id=mask_id), 4),
        "diffusion B=8, k=6, 3 steps": (DiffusionDrafter(model, 3, block_size=8, mask_id=mask_id), 6),
        "diffusion B=1": (DiffusionDrafter(model, 1, block_size=1, mask_id=mask_id), 1),
        "bad diffusion": (DiffusionDrafter(bad_model, 2, block_size=4, mask_id=mask_id), 3),
        "window k=3": (WindowDrafter(model, 1, mask_id=mask_id), 3),
        "window k=5, 2 steps": (WindowDrafter(model, 2, mask_id=mask_id), 5),
        "bad window": (WindowDrafter(bad_model, 1, mask_id=mask_id), 4),
        "perfect": (PerfectDrafter(model), 4),
        "random": (RandomDrafter(), 4),
    }


NAMES = ["diffusion k=1", "diffusion k=B=4, 2 steps", "diffusion B=8, k=6, 3 steps", "diffusion B=1", "bad diffusion",
         "window k=3", "window k=5, 2 steps", "bad window", "perfect", "random"]


@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_ar(model, bad_model, prompts, mask_id, ar_ref, eos, name) -> None:
    drafter, k = drafters(model, bad_model, mask_id)[name]
    with_eos = spec(model, drafter, prompts, draft_len=k, eos_id=eos)
    assert with_eos.sequences == cut(ar_ref, eos)
    assert len({len(s) for s in with_eos.sequences}) > 1  # rows finished at different rounds
    check_counts(with_eos, len(prompts))
    out = spec(model, drafter, prompts, draft_len=k)  # no eos: every row runs to NEW (the stats below)
    assert out.sequences == ar_ref
    check_counts(out, len(prompts))
    if name == "perfect":
        # Every draft accepted; the AR model spends fewer forwards than tokens.
        assert out.accepted_tokens == out.drafted_tokens > 0
        assert out.ar_nfe < max(len(s) for s in out.sequences)
        assert out.mean_accepted_length > 2.5
    if name in ("random", "bad diffusion", "bad window"):
        assert out.mean_accepted_length < 0.3
    if name == "diffusion B=1":
        # The same network with block size 1 is the AR model: every draft is accepted.
        assert out.accepted_tokens == out.drafted_tokens > 0


@pytest.mark.parametrize("kind", ["diffusion", "window"])
def test_batch_of_one_equals_batched(model, prompts, mask_id, ar_ref, kind) -> None:
    """Ragged rows (prompts of 1 to 16 tokens, different acceptances) draft as each row alone."""
    if kind == "diffusion":
        drafter = DiffusionDrafter(model, 2, block_size=4, mask_id=mask_id)
    else:
        drafter = WindowDrafter(model, 2, mask_id=mask_id)
    batched = spec(model, drafter, prompts)
    for i, prompt in enumerate(prompts):
        alone = spec(model, drafter, [prompt])
        assert alone.sequences == [ar_ref[i]] == [batched.sequences[i]]
        check_counts(alone, 1)
        # At batch 1 acceptance does not depend on the other rows.
        assert alone.accepted_lengths[0] == batched.accepted_lengths[i]


def test_window_drafter_feeds_each_accepted_token_once(model, prompts, mask_id, monkeypatch) -> None:
    """Each round's drafter forward holds the tokens accepted since the last one, then the window: never a whole block."""
    widths: list[tuple[int, int]] = []
    real = sp._AcceptedKVCache.forward

    def spy(self, ids, pos, valid, logits_to_keep=0, bidirectional=False):
        if bidirectional:
            widths.append((ids.shape[1], int(valid.sum())))
        return real(self, ids, pos, valid, logits_to_keep, bidirectional)

    monkeypatch.setattr(sp._AcceptedKVCache, "forward", spy)
    k = 3
    drafter = WindowDrafter(model, 1, mask_id=mask_id)
    out = spec(model, drafter, prompts[:1], draft_len=k)
    acc = out.accepted_lengths[0]
    # Round 1 feeds the last prompt token; round r the tokens round r - 1 accepted (its drafts + the AR token).
    fed = [1] + [a + 1 for a in acc[:-1]]
    before = [sum(fed[1 : r + 1]) for r in range(len(fed))]  # accepted tokens before round r
    window = [min(k, NEW - n - 1) for n in before]  # the draft never passes max_new_tokens
    assert widths == [(m + w, m + w) for m, w in zip(fed, window) if w > 0]
    assert len(widths) == out.drafts and drafter.nfe == out.drafts + 1  # + the prompt's prefill
    assert int(drafter.fed[0]) == len(prompts[0]) - 1 + sum(m for m, w in zip(fed, window) if w > 0)


# ---------------------------------------------------------------- rollback


def test_drafts_after_rejections_equal_drafts_from_scratch(model, prompts, mask_id, monkeypatch) -> None:
    """The drafter's cache after accepted and rejected rounds gives the drafts a fresh drafter gives."""
    bsz, k = 4, 3
    rounds: list[tuple[int, list[int], int, list[int]]] = []
    real = DiffusionDrafter.draft

    def spy(self, response, length, count, temperature, generator):
        d = real(self, response, length, count, temperature, generator)
        for r in range(length.shape[0]):
            n = int(length[r])
            drafted = d.tokens[r, : int(d.lengths[r])].tolist()
            rounds.append((self.tag[r], response[r, :n].tolist(), int(count[r]), drafted))
        return d

    real_select = DiffusionDrafter.select

    def select(self, alive):
        self.tag = [self.tag[i] for i in alive.tolist()]
        real_select(self, alive)

    monkeypatch.setattr(DiffusionDrafter, "draft", spy)
    monkeypatch.setattr(DiffusionDrafter, "select", select)
    drafter = DiffusionDrafter(model, 2, block_size=bsz, mask_id=mask_id)
    drafter.tag = list(range(len(prompts)))
    out = spec(model, drafter, prompts, draft_len=k)
    assert 0 < out.accepted_tokens < out.drafted_tokens  # some drafts rejected, some accepted
    monkeypatch.setattr(DiffusionDrafter, "draft", real)
    checked = 0
    for row, prefix, count, tokens in rounds:
        if len(prefix) < bsz + 1 or count == 0:
            continue  # keep the ones with a finished block behind them
        fresh = DiffusionDrafter(model, 2, block_size=bsz, mask_id=mask_id)
        ids = torch.tensor([prompts[row]])
        fresh.begin(ids, torch.ones_like(ids), NEW, VOCAB)
        resp = torch.tensor([prefix])
        d = fresh.draft(resp, torch.tensor([len(prefix)]), torch.tensor([count]), 0.0, None)
        assert d.tokens[0, : int(d.lengths[0])].tolist() == tokens
        checked += 1
    assert checked >= 10


def test_verify_logits_after_rejections_equal_a_full_forward(model, bad_model, prompts, mask_id, monkeypatch) -> None:
    """The AR cache rolled back after rejections scores each chunk as a from-scratch forward would."""

    chunks: list[tuple[list[int], int, torch.Tensor]] = []
    real = sp._AcceptedKVCache.forward

    def spy(self, ids, pos, valid, logits_to_keep=0):
        logits = real(self, ids, pos, valid, logits_to_keep)
        if logits_to_keep == 0:  # a verify forward (not the prefill); batch 1 here
            n = int(valid[0].sum())
            chunks.append((ids[0, :n].tolist(), int(pos[0, 0]), logits[0, :n].clone()))
        return logits

    monkeypatch.setattr(sp._AcceptedKVCache, "forward", spy)
    for prompt in prompts:
        chunks.clear()
        out = spec(model, DiffusionDrafter(bad_model, 2, block_size=4, mask_id=mask_id), [prompt], draft_len=4)
        assert out.drafted_tokens > out.accepted_tokens  # rejections happened
        full_seq = prompt + out.sequences[0]
        for ids, first_pos, logits in chunks:
            # Positions count from the prompt's first token: the chunk's first
            # token (the last accepted one) sits at full_seq[first_pos].
            assert full_seq[first_pos] == ids[0]
            with torch.no_grad():
                ref = model(input_ids=torch.tensor([full_seq[:first_pos] + ids])).logits[0, first_pos:]
            assert torch.allclose(logits, ref, atol=1e-4)


# ---------------------------------------------------------------- edge cases


@pytest.mark.parametrize("limit", [1, 2, 3, 6, 7])
def test_max_new_tokens_mid_draft(model, prompts, ar_ref, limit) -> None:
    # k = 4 with a perfect drafter: the limit falls inside a round's draft.
    out = spec(model, PerfectDrafter(model), prompts, draft_len=4, max_new_tokens=limit)
    assert out.sequences == [s[:limit] for s in ar_ref]
    check_counts(out, len(prompts))


def test_eos_inside_the_accepted_draft(model, prompts, ar_ref) -> None:
    # eos = row 0's third token: the perfect drafter drafts it in its first
    # round (k = 4), it is accepted and the row is cut right after it.
    eos = ar_ref[0][2]
    out = spec(model, PerfectDrafter(model), prompts[:1], draft_len=4, eos_id=eos)
    assert out.sequences == cut(ar_ref[:1], eos) and len(out.sequences[0]) == 3
    assert out.accepted_lengths == [[3]] and out.verifications == 1
    out = spec(model, PerfectDrafter(model), prompts, draft_len=4, eos_id=eos)
    assert out.sequences == cut(ar_ref, eos)


def test_zero_new_tokens_and_bad_args(model, prompts, mask_id) -> None:
    drafter = DiffusionDrafter(model, 1, block_size=4, mask_id=mask_id)
    out = spec(model, drafter, prompts, max_new_tokens=0)
    assert out.sequences == [[] for _ in prompts] and out.nfe == 0 and out.generated_tokens == 0
    with pytest.raises(ValueError):
        spec(model, drafter, prompts, draft_len=0)
    with pytest.raises(ValueError):
        DiffusionDrafter(model, 0, block_size=4, mask_id=mask_id)
    with pytest.raises(ValueError):
        DiffusionDrafter(model, 1)  # not a converted model: no block_size / mask_token_id in its config


# ---------------------------------------------------------------- acceptance rules


def test_accept_greedy_by_hand() -> None:
    draft = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 6, 7]])
    lengths = torch.tensor([3, 3, 2])
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    logits = torch.nn.functional.one_hot(target, 10).float()
    acc, nxt = accept_greedy(draft, lengths, logits)
    assert acc.tolist() == [3, 1, 0] and nxt.tolist() == [8, 6, 5]
    # A draft token past a row's length is never accepted.
    acc, nxt = accept_greedy(draft, torch.tensor([2, 3, 0]), logits)
    assert acc.tolist() == [2, 1, 0] and nxt.tolist() == [7, 6, 5]


def test_accept_sampling_by_hand() -> None:
    g = torch.Generator().manual_seed(0)
    v = 5
    p = torch.softmax(torch.randn((1, 3, v), generator=g), -1)
    # q = p: every draft accepted, whatever was drawn.
    draft = torch.tensor([[1, 3]])
    acc, _ = accept_sampling(draft, torch.tensor([2]), p[:, :2], p, g)
    assert acc.tolist() == [2]
    # q puts all mass where p has none: rejected at once, and the resample
    # comes from p's own support (the residual is p itself).
    p0 = torch.tensor([[[0.0, 0.5, 0.5, 0.0, 0.0], [0.2] * 5]])
    q0 = torch.tensor([[[1.0, 0.0, 0.0, 0.0, 0.0]]])
    for _ in range(20):
        acc, nxt = accept_sampling(torch.tensor([[0]]), torch.tensor([1]), q0, p0, g)
        assert acc.tolist() == [0] and nxt.item() in (1, 2)


def test_sampling_probs_is_ar_generates_rule() -> None:
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0, -2.0]])
    assert torch.allclose(sampling_probs(logits, 1.0), torch.softmax(logits, -1))
    p = sampling_probs(logits, 0.5, top_k=2)
    assert (p[0, 3:] == 0).all() and p[0, 1] == p[0, 2] > 0  # ties at the k-th value are kept


# ---------------------------------------------------------------- sampling: the distribution is AR's

TOY_VOCAB = 6  # ids 0 pad, 1 bos, 2 eos, 3 4 words, 5 the drafter's mask
TOY_LEN = 3
TOY_EOS = 2


def toy_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    cfg = replace(DECODER, max_position_embeddings=32)
    ar = randomize(build_ar_model(cfg, TOY_VOCAB, pad_id=PAD, bos_id=1, eos_id=TOY_EOS, seed=0), 0.4, seed=3)
    draft = randomize(build_ar_model(cfg, TOY_VOCAB, pad_id=PAD, bos_id=1, eos_id=TOY_EOS, seed=1), 0.4, seed=4)
    return ar.eval(), draft.eval()


def exact_distribution(model, prompt: list[int], temperature: float, top_k: int) -> dict[tuple[int, ...], float]:
    """P(response) under `ar_generate`'s sampling, for every response of <= TOY_LEN tokens (cut at eos)."""
    dist: dict[tuple[int, ...], float] = {}
    frontier = {(): 1.0}
    for _ in range(TOY_LEN):
        nxt: dict[tuple[int, ...], float] = {}
        for seq, pr in frontier.items():
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + list(seq)])).logits[0, -1]
            p = sampling_probs(logits[None], temperature, top_k)[0].tolist()
            for t, pt in enumerate(p):
                if pt == 0.0:
                    continue
                (dist if t == TOY_EOS else nxt)[seq + (t,)] = pr * pt
        frontier = nxt
    dist.update(frontier)
    return dist


def chi_square_p(samples: list[list[int]], exact: dict[tuple[int, ...], float]) -> float:
    """p-value of a chi-square goodness of fit; cells expecting < 5 are pooled into one."""
    n = len(samples)
    counts: dict[tuple[int, ...], int] = {}
    for s in samples:
        counts[tuple(s)] = counts.get(tuple(s), 0) + 1
    assert set(counts) <= set(exact)  # never a response of probability 0
    big = [c for c in exact if exact[c] * n >= 5]
    obs = [counts.get(c, 0) for c in big]
    exp = [exact[c] * n for c in big]
    obs.append(n - sum(obs))
    exp.append(n - sum(exp))
    return float(chisquare(obs, exp).pvalue)


@pytest.mark.parametrize(
    "draft_len, steps, block_size, temperature, top_k",
    [(2, 1, 4, 1.0, 0), (2, 2, 4, 1.0, 0), (2, 2, 2, 0.7, 4), (2, 2, 0, 1.0, 0)],
)
def test_sampling_matches_the_exact_ar_distribution(draft_len, steps, block_size, temperature, top_k) -> None:
    ar, draft_model = toy_models()
    prompts = [[3, 4, 3], [4]]
    n = 4000
    # block_size 0 stands for the window drafter (no blocks).
    if block_size:
        drafter = DiffusionDrafter(draft_model, steps, block_size=block_size, mask_id=5)
    else:
        drafter = WindowDrafter(draft_model, steps, mask_id=5)
    g = torch.Generator().manual_seed(0)
    out = speculative_generate(
        ar, drafter, prompts * n, pad_id=PAD, eos_id=TOY_EOS, max_new_tokens=TOY_LEN, draft_len=draft_len,
        temperature=temperature, top_k=top_k, generator=g,
    )
    # The drafter is a different network: many drafts are rejected and resampled
    # (the window drafter's, which sees fewer positions, more often).
    assert (0.2 if block_size else 0.1) < out.acceptance_rate < 0.9
    for i, prompt in enumerate(prompts):
        exact = exact_distribution(ar, prompt, temperature, top_k)
        assert abs(sum(exact.values()) - 1.0) < 1e-5
        assert chi_square_p(out.sequences[i::2], exact) > 1e-3


def test_sampling_with_test_drafters_matches_too() -> None:
    ar, _ = toy_models()
    prompt = [3, 4, 3]
    exact = exact_distribution(ar, prompt, 1.0, 0)
    for drafter in (RandomDrafter(1), PerfectDrafter(ar)):
        g = torch.Generator().manual_seed(1)
        n = 3000 if isinstance(drafter, RandomDrafter) else 600  # the perfect drafter loops over rows
        out = speculative_generate(
            ar, drafter, [prompt] * n, pad_id=PAD, eos_id=TOY_EOS, max_new_tokens=TOY_LEN, draft_len=2,
            temperature=1.0, generator=g,
        )
        assert chi_square_p(out.sequences, exact) > 1e-3


# ---------------------------------------------------------------- benchmark helper (no timing asserted)


def test_benchmark_helper_reports(model, prompts, mask_id) -> None:
    drafter = DiffusionDrafter(model, 2, block_size=4, mask_id=mask_id)
    b = speculative_benchmark(model, drafter, prompts[:2], pad_id=PAD, eos_id=NO_EOS, max_new_tokens=12, draft_len=4,
                              repeats=1)
    assert b.tokens_equal and b.generated_tokens == 24 and b.batch_size == 2 and b.repeats == 1
    assert b.speedup > 0 and b.ar_tokens_per_s > 0 and b.spec_tokens_per_s > 0
    assert 0 <= b.mean_accepted_length <= 4 and 0 <= b.acceptance_rate <= 1
    assert 0 < b.ar_forwards_per_token <= 1 + 1 / 12  # the prefill, then at most one verify per token
    assert b.draft_forwards_per_token > 0
