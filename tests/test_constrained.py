"""Format-constrained decoding (`gr2model.decoding.constrained`): every answer valid, and no other change.

A scripted fake model writes a chosen token sequence, so the tests control exactly
what the unconstrained decoders would write; random tiny models write garbage that
the grammar must still turn into valid rankings.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.modeling_utils import slice_logits_to_keep

from gr2model.decoding.ar_decode import ar_generate
from gr2model.decoding.constrained import ResponseGrammar, answer_template
from gr2model.decoding.diffusion_decode import diffusion_generate
from gr2model.eval.rerank_eval import explanation_nll, lm_rerank, prompts_of
from gr2model.task.rerank_format import EOS, FormatConfig, build_response, parse_response
from gr2model.task.tokenizer import special_ids

from tiny import tiny_model, toy_items, toy_tokenizer

FMT = FormatConfig(history_len=0, with_attributes=False, answer="index", answer_first=True)
CANDIDATES = [1, 2, 3, 4]
PROMPT = [7, 8, 9]  # any ids: the scripted model ignores the prompt's tokens
MAX_NEW = 40


@pytest.fixture(scope="module")
def tok():
    return toy_tokenizer()


@pytest.fixture(scope="module")
def ids(tok) -> dict[str, int]:
    return special_ids(tok)


def answer_ids(tok, ranking: list[int], words: list[str]) -> list[int]:
    """The token ids of the answer-first index response, eos included."""
    text = build_response(words, ranking, toy_items(), fmt=FMT, candidates=CANDIDATES) + f" {EOS}"
    return tok.convert_tokens_to_ids(text.split())


class Scripted(torch.nn.Module):
    """A fake model that writes `script`: the column at position id q gives response
    position q + 1 - len(PROMPT) its scripted token with logit `strength` (every other
    logit 0). Past the script: no preference."""

    def __init__(self, script: list[int], vocab: int, strength: float = 12.0) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # the decoders read its device
        self.config = type("Config", (), {"num_hidden_layers": 1, "vocab_size": vocab})()
        self.script, self.vocab, self.strength = script, vocab, strength

    def forward(self, input_ids, position_ids=None, logits_to_keep=0, **_):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1])[None].expand(input_ids.shape[0], -1)
        r = position_ids + 1 - len(PROMPT)
        logits = torch.zeros((*input_ids.shape, self.vocab))
        ok = (r >= 0) & (r < len(self.script))
        want = torch.tensor(self.script)[r.clamp(0, len(self.script) - 1)]
        logits.scatter_(-1, want[..., None], torch.where(ok, self.strength, 0.0)[..., None])
        return type("Out", (), {"logits": slice_logits_to_keep(logits, logits_to_keep)})()


def grammar(tok, rows: int = 1, k: int = 4, max_new: int = MAX_NEW) -> ResponseGrammar:
    return ResponseGrammar(tok, [k] * rows, max_new)


def judge(tok, seq: list[int]):
    return parse_response(tok.decode(seq, skip_special_tokens=False), CANDIDATES, toy_items(), fmt=FMT)


def decode_both(model, tok, ids, **kw):
    """(AR free, AR constrained, diffusion free, diffusion constrained) outputs of one prompt."""
    common = dict(pad_id=ids["pad"], eos_id=ids["eos"], max_new_tokens=MAX_NEW)
    dif = dict(common, mask_id=ids["mask"], block_size=8, threshold=0.9, **kw)
    return (
        ar_generate(model, [PROMPT], **common),
        ar_generate(model, [PROMPT], **common, grammar=grammar(tok)),
        diffusion_generate(model, [PROMPT], **dif),
        diffusion_generate(model, [PROMPT], **dif, grammar=grammar(tok)),
    )


def test_template_length_and_codes(tok) -> None:
    for k in (1, 4, 10):
        assert len(answer_template(k)) == 4 * k + 8
    script = answer_ids(tok, [2, 1, 4, 3], ["because", "first"])
    g = grammar(tok)
    codes = g.codes[0].tolist()
    assert len(codes) == MAX_NEW
    for r, token in enumerate(script[: 4 * 4 + 8]):  # the template: fixed tokens, and the slots
        assert codes[r] == token or (codes[r] == -1 and tok.convert_ids_to_tokens(token).startswith("<pos_"))
    assert codes[-3:] == tok.convert_tokens_to_ids(['"', "}", EOS])
    with pytest.raises(ValueError, match="too short"):
        ResponseGrammar(tok, [4], 4 * 4 + 8 + 2)


@pytest.mark.parametrize("sub", [None, 4])
def test_a_valid_script_is_decoded_unchanged(tok, ids, sub) -> None:
    model = Scripted(answer_ids(tok, [2, 1, 4, 3], ["because", "first", "likes"]), len(tok))
    ar, ar_c, dif, dif_c = decode_both(model, tok, ids, sub_block_size=sub)
    assert judge(tok, ar.sequences[0]).ranking == [2, 1, 4, 3]
    assert ar_c.sequences == ar.sequences and ar_c.constrained == [False]
    assert dif.sequences == ar.sequences
    assert dif_c.sequences == dif.sequences and dif_c.nfe == dif.nfe and dif_c.constrained == [False]
    assert ar.constrained is None and dif.constrained is None


@pytest.mark.parametrize(
    "break_it",
    [
        lambda s, t: s[:-6] + [t["eos"]] + s[-5:],  # an eos inside the explanation
        lambda s, t: s[:-4] + [t["quote"]] + s[-3:],  # a stray quote before the end
        lambda s, t: s[:5] + [s[9]] + s[6:],  # the first slot repeats the second's candidate
        lambda s, t: s[:-1] + [t["close"], t["eos"]],  # `" } } eos`
        lambda s, t: s[:-3],  # no end: the model never writes `" } eos`
    ],
)
@pytest.mark.parametrize("sub", [None, 4])
def test_a_broken_script_becomes_a_valid_answer(tok, ids, break_it, sub) -> None:
    special = {"eos": ids["eos"], "quote": tok.convert_tokens_to_ids('"'), "close": tok.convert_tokens_to_ids("}")}
    script = break_it(answer_ids(tok, [2, 1, 4, 3], ["because", "first", "likes", "first"]), special)
    ar, ar_c, dif, dif_c = decode_both(Scripted(script, len(tok)), tok, ids, sub_block_size=sub)
    assert not judge(tok, ar.sequences[0]).valid_permutation  # the broken script, as the free decoders write it
    assert not judge(tok, dif.sequences[0]).valid_permutation
    for out in (ar_c, dif_c):
        parsed = judge(tok, out.sequences[0])
        assert parsed.valid_permutation, (parsed.error, tok.decode(out.sequences[0]))
        assert out.constrained == [True]
        assert out.sequences[0][-1] == ids["eos"]


@pytest.mark.parametrize("block_size, threshold, sub", [(1, 0.9, None), (8, 0.9, None), (8, 0.0, None), (8, 0.5, 4), (16, 0.3, 8), (8, 2.0, 2)])
def test_random_models_always_write_valid_answers(tok, ids, block_size, threshold, sub) -> None:
    """Untrained models write garbage; under the grammar every answer is a valid permutation,
    whatever the block size, threshold, sub-block size, batch and left padding."""
    prompts = [[7 + (i * 5 + j) % 20 for j in range(3 + i % 4)] for i in range(6)]
    ks = [4, 3, 4, 2, 4, 1]
    for seed in range(3):
        model = tiny_model(tok, seed=seed, scale=1.0).eval()
        g = ResponseGrammar(tok, ks, MAX_NEW, vocab_size=model.config.vocab_size)
        common = dict(pad_id=ids["pad"], eos_id=ids["eos"], max_new_tokens=MAX_NEW, grammar=g)
        outs = [
            ar_generate(model, prompts, **common),
            diffusion_generate(model, prompts, **common, mask_id=ids["mask"], block_size=block_size, threshold=threshold, sub_block_size=sub),
        ]
        for out in outs:
            for seq, k in zip(out.sequences, ks, strict=True):
                parsed = parse_response(tok.decode(seq, skip_special_tokens=False), CANDIDATES[:k], toy_items(), fmt=FMT)
                assert parsed.valid_permutation, (parsed.error, tok.decode(seq))


def test_allowed_by_hand(tok) -> None:
    g = grammar(tok)
    quote, close, eos = (tok.convert_tokens_to_ids(t) for t in ('"', "}", EOS))
    pos = [tok.convert_tokens_to_ids(f"<pos_{k}>") for k in range(1, 5)]
    word = tok.convert_tokens_to_ids("because")
    resp = torch.zeros((1, MAX_NEW), dtype=torch.long)
    com = torch.zeros((1, MAX_NEW), dtype=torch.bool)
    resp[0, 5], com[0, 5] = pos[1], True  # the first slot (response position 5) holds <pos_2>
    l0 = 4 * 4 + 8
    st = g.state(torch.tensor([0]), resp, com)
    a = g.allowed(st, torch.tensor([[0, 9, l0, MAX_NEW - 3]]))[0]
    assert a[0].nonzero().flatten().tolist() == [tok.convert_tokens_to_ids("{")]
    assert sorted(a[1].nonzero().flatten().tolist()) == sorted([pos[0], pos[2], pos[3]])  # not <pos_2>: used
    assert a[2, word] and a[2, quote] and not a[2, eos] and not a[2, close]  # the first word: or an empty explanation
    assert a[3, word] and a[3, eos]  # an earlier end may still cut it off
    # Words up to the last three positions: the end is forced there, so no answer runs out.
    full_resp, full_com = resp.clone(), com.clone()
    full_resp[0, l0 : MAX_NEW - 3], full_com[0, l0 : MAX_NEW - 3] = word, True
    st = g.state(torch.tensor([0]), full_resp, full_com)
    a = g.allowed(st, torch.tensor([[MAX_NEW - 3, MAX_NEW - 2, MAX_NEW - 1]]))[0]
    assert [row.nonzero().flatten().tolist() for row in a] == [[quote], [close], [eos]]
    # Words up to p - 3 and an eos at p: the end is `" } eos` at p - 2 (no earlier end is left); after it, anything (cut).
    p = l0 + 6
    resp[0, l0 : p - 2], com[0, l0 : p - 2] = word, True
    resp[0, p], com[0, p] = eos, True
    st = g.state(torch.tensor([0]), resp, com)
    a = g.allowed(st, torch.tensor([[p - 2, p - 1, p + 1]]))[0]
    assert a[0].nonzero().flatten().tolist() == [quote]
    assert a[1].nonzero().flatten().tolist() == [close]
    assert a[2, word] and a[2, eos]


def test_consistent_by_hand(tok) -> None:
    g = grammar(tok)
    quote, close, eos = (tok.convert_tokens_to_ids(t) for t in ('"', "}", EOS))
    word = tok.convert_tokens_to_ids("because")
    pos2 = tok.convert_tokens_to_ids("<pos_2>")
    empty = g.state(torch.tensor([0]), torch.zeros((1, MAX_NEW), dtype=torch.long), torch.zeros((1, MAX_NEW), dtype=torch.bool))
    l0 = 4 * 4 + 8
    every = torch.ones((1, 4), dtype=torch.bool)

    def kept(positions, tokens, conf):
        return g.consistent(empty, every, torch.tensor([tokens]), torch.tensor([conf]), torch.tensor([positions]))[0].tolist()

    # Two slots pick <pos_2>: the more confident keeps it.
    assert kept([5, 9, 13, 0], [pos2, pos2, pos2, tok.convert_tokens_to_ids("{")], [0.5, 0.9, 0.7, 0.99]) == [False, True, False, True]
    # The end and eos padding after it, in one step: the first end is the answer's, the padding is cut.
    e = l0 + 3
    assert kept([e, e + 1, e + 2, e + 3], [quote, close, eos, eos], [0.9, 0.8, 0.95, 0.99]) == [True, True, True, True]
    # A word inside the chosen tail is dropped; a word before it stays.
    assert kept([e - 1, e, e + 1, e + 2], [word, quote, word, eos], [0.6, 0.99, 0.7, 0.9]) == [True, True, False, True]
    # Tail tokens of two different ends before the later eos: the first end's kept.
    assert kept([e, e + 2, e + 3, e + 4], [quote, eos, close, eos], [0.5, 0.6, 0.7, 0.99]) == [True, True, True, True]
    assert kept([e, e + 1, e + 2, e + 3], [quote, eos, word, word], [0.99, 0.5, 0.6, 0.7]) == [True, False, False, True]


def test_explanation_threshold(tok, ids) -> None:
    """The answer decoded at the strict threshold, the explanation at a loose one: fewer forwards, still valid."""
    model = tiny_model(tok, seed=1, scale=1.0).eval()
    common = dict(pad_id=ids["pad"], eos_id=ids["eos"], mask_id=ids["mask"], max_new_tokens=MAX_NEW, block_size=8, threshold=2.0)
    strict = diffusion_generate(model, [PROMPT], **common, grammar=grammar(tok))
    loose = diffusion_generate(model, [PROMPT], **common, grammar=grammar(tok), explanation_threshold=0.0)
    assert loose.nfe < strict.nfe
    assert judge(tok, loose.sequences[0]).valid_permutation
    with pytest.raises(ValueError, match="need a grammar"):
        diffusion_generate(model, [PROMPT], **common, explanation_threshold=0.0)


def test_explanation_sub_blocks(tok, ids) -> None:
    """Sub-blocks of 2 in the answer's blocks, whole blocks of 8 past it: the answer's blocks commit
    sub-block by sub-block, the later ones anywhere in the block; the same size twice is the plain decoder."""
    model = tiny_model(tok, seed=3, scale=1.0).eval()
    common = dict(pad_id=ids["pad"], eos_id=ids["eos"], mask_id=ids["mask"], max_new_tokens=MAX_NEW, block_size=8, threshold=2.0, return_trace=True)
    plain = diffusion_generate(model, [PROMPT], **common, sub_block_size=2, grammar=grammar(tok))
    same = diffusion_generate(model, [PROMPT], **common, sub_block_size=2, explanation_sub_block_size=2, grammar=grammar(tok))
    assert same.sequences == plain.sequences and same.steps == plain.steps
    split = diffusion_generate(model, [PROMPT], **common, sub_block_size=2, explanation_sub_block_size=8, grammar=grammar(tok))
    assert judge(tok, split.sequences[0]).valid_permutation
    steps = split.steps[0] + split.tail_steps[0]
    l0 = 4 * 4 + 8  # the answer fills blocks 0-2 exactly
    for start in range(0, l0, 2):  # one token per step: a sub-block's steps all come before the next one's
        if start + 2 < l0 and start % 8 != 6:
            assert max(steps[start : start + 2]) < min(steps[start + 2 : start + 4])
    explanation = [steps[b : b + 8] for b in range(l0, len(steps) - 7, 8)]
    assert any(blk != sorted(blk) for blk in explanation)  # whole blocks: not left to right
    with pytest.raises(ValueError, match="must be >= 1 and divide"):
        diffusion_generate(model, [PROMPT], **common, explanation_sub_block_size=3, grammar=grammar(tok))


def test_explanation_sub_blocks_batch_equals_rows_alone(tok, ids) -> None:
    """Rows with 4, 2 and 3 candidates reach the explanation at different blocks, so a step of the
    batch mixes answer and explanation blocks (whole-block logits, each row's commits restricted to
    its window); a row alone always has one kind (that window's logits only). Both give the row
    the same tokens and steps, cached or recomputed."""
    model = tiny_model(tok, seed=5, scale=1.0).eval()
    prompts, ks = [[7, 8, 9], [7, 9, 8, 9, 7, 8], [9, 8]], [4, 2, 3]
    kw = dict(pad_id=ids["pad"], eos_id=ids["eos"], mask_id=ids["mask"], max_new_tokens=MAX_NEW, block_size=8, threshold=0.3,
              sub_block_size=2, explanation_sub_block_size=8, explanation_threshold=0.2, return_trace=True)  # fmt: skip
    batched = diffusion_generate(model, prompts, **kw, grammar=ResponseGrammar(tok, ks, MAX_NEW))
    recomputed = diffusion_generate(model, prompts, **kw, grammar=ResponseGrammar(tok, ks, MAX_NEW), use_cache=False)
    assert recomputed.sequences == batched.sequences and recomputed.nfe == batched.nfe
    for i, (prompt, k) in enumerate(zip(prompts, ks, strict=True)):
        alone = diffusion_generate(model, [prompt], **kw, grammar=ResponseGrammar(tok, [k], MAX_NEW))
        assert alone.sequences[0] == batched.sequences[i] and alone.steps[0] == batched.steps[i]
    assert judge(tok, batched.sequences[0]).valid_permutation  # the row with this test's 4 candidates


def test_errors(tok, ids) -> None:
    model = Scripted([ids["eos"]], len(tok))
    with pytest.raises(ValueError, match="greedy only"):
        ar_generate(model, [PROMPT], pad_id=ids["pad"], eos_id=ids["eos"], max_new_tokens=MAX_NEW, temperature=1.0, grammar=grammar(tok))
    with pytest.raises(ValueError, match="grammar built for"):
        ar_generate(model, [PROMPT, PROMPT], pad_id=ids["pad"], eos_id=ids["eos"], max_new_tokens=MAX_NEW, grammar=grammar(tok))


def test_lm_rerank_constrained(tok) -> None:
    """`lm_rerank(constrained=True)`: every answer of a random model parses, the outputs say which
    the grammar changed; a format the grammar does not cover is refused before decoding."""
    import polars as pl

    model = tiny_model(tok, seed=2, scale=1.0).eval()
    lists = pl.DataFrame({"history": [[1], [2, 3]], "candidates": [[1, 2, 3, 4], [4, 3]], "target": [2, 3]})
    out = lm_rerank(model, tok, lists, toy_items(), FMT, max_new_tokens=MAX_NEW, constrained=True)
    assert all(p.valid_permutation for p in out.parsed)
    assert all(o.constrained is not None for o in out.outputs)
    with pytest.raises(ValueError, match="answer-first index"):
        lm_rerank(model, tok, lists, toy_items(), FormatConfig(history_len=0, with_attributes=False), max_new_tokens=MAX_NEW, constrained=True)


def test_explanation_nll(tok) -> None:
    """GR2's NLL per token of what follows the template: low for the explanation it writes itself,
    high for another; NaN for an answer that stops inside the template."""
    import polars as pl

    lists = pl.DataFrame({"history": [[1], [2]], "candidates": [CANDIDATES, CANDIDATES], "target": [2, 3]})
    prompt_len = len(tok(prompts_of(lists, toy_items(), FMT)[0], add_special_tokens=False)["input_ids"])
    own = answer_ids(tok, [2, 1, 4, 3], ["because", "first", "likes"])
    other = answer_ids(tok, [2, 1, 4, 3], ["likes", "likes", "because"])

    class Writer(Scripted):  # writes `own` after a prompt of this length
        def forward(self, input_ids, position_ids=None, **kw):
            return super().forward(input_ids, position_ids=position_ids - prompt_len + len(PROMPT), **kw)

    scorer = Writer(own, len(tok))
    nll = explanation_nll(scorer, tok, lists, toy_items(), FMT, [own, other])
    assert nll[0] < 0.01 < 1.0 < nll[1]
    assert np.isnan(explanation_nll(scorer, tok, lists, toy_items(), FMT, [own[:10], own]))[0]



def test_explanation_nll_reasoning_first(tok) -> None:
    """Reasoning first, the explanation is the words between `{ "explanation" : "` and the next quote:
    only they are scored (the ranking after them is not), and an answer that does not open with an
    explanation, or never closes it, has none."""
    import polars as pl

    fmt = FormatConfig(history_len=0, with_attributes=False, answer="index", answer_first=False)
    lists = pl.DataFrame({"history": [[1], [2], [3], [4]], "candidates": [CANDIDATES] * 4, "target": [2, 3, 1, 4]})
    prompt_len = len(tok(prompts_of(lists, toy_items(), fmt)[0], add_special_tokens=False)["input_ids"])

    def ids(ranking: list[int], words: list[str]) -> list[int]:
        text = build_response(words, ranking, toy_items(), fmt=fmt, candidates=CANDIDATES) + f" {EOS}"
        return tok.convert_tokens_to_ids(text.split())

    own = ids([2, 1, 4, 3], ["because", "first", "likes"])

    class Writer(Scripted):  # writes `own` after a prompt of this length
        def forward(self, input_ids, position_ids=None, **kw):
            return super().forward(input_ids, position_ids=position_ids - prompt_len + len(PROMPT), **kw)

    scorer = Writer(own, len(tok))
    same_words = ids([3, 4, 1, 2], ["because", "first", "likes"])  # another ranking after the same reasoning
    other = ids([2, 1, 4, 3], ["likes", "likes", "because"])
    nll = explanation_nll(scorer, tok, lists, toy_items(), fmt, [own, same_words, other, answer_ids(tok, [2, 1, 4, 3], ["because"])])
    assert nll[0] < 0.01 and nll[1] == pytest.approx(nll[0]) and nll[2] > 1.0
    assert np.isnan(nll[3])  # an answer-first response: no reasoning-first explanation to score
    unclosed = own[:6]
    assert np.isnan(explanation_nll(scorer, tok, lists.head(1), toy_items(), fmt, [unclosed]))[0]
