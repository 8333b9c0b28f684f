"""Reasoning first on a toy re-ranking task: the decision written inside the reasoning is learned, and carried.

Six candidates, one of them marked by its evidence level (the top level, the others
lower): the right first item is that one, the rest follow in incoming order. The
reasoning-first trace names it inside the explanation (`pick <pos_k> because strong`)
before the answer; the answer-first trace writes the same explanation after the
answer. With the same tiny model, data and budget, both learn the decision on held-out
lists. And the reasoning-first answer follows its reasoning: forced to cite another
candidate in its explanation, the model writes that one first in its answer, never the
marked one (the rest of such an answer, learned as "the incoming order without the
chosen one", is often not a permutation then: the first item is what is checked).
"""

from __future__ import annotations

import random

import polars as pl
import pytest
import torch
from gr2model.decoding.ar_decode import ar_generate
from gr2model.task.rerank_format import (
    POSITION_RE, REASONING_FIRST_OPENING, RECOMMENDATIONS_KEY, FormatConfig, ItemText, ParsedResponse, build_prompt, build_response, parse_response,
    pos_token,
)
from gr2model.training.sft import SFTConfig, train_sft
from gr2model.task.tokenizer import build_tokenizer, special_ids

from tiny import TOY, tiny_model

N_ITEMS, K = 40, 6
WORDS = ["pick", "because", "strong"]
TOP = 3  # the marked candidate's evidence level; the others draw from 0..TOP-1

List = tuple[list[int], list[int], list[list[int]], int]  # history, candidates, evidence levels, the marked candidate


def _items() -> pl.DataFrame:
    ids = list(range(1, N_ITEMS + 1))
    return pl.DataFrame(
        {"item_id": ids, "sid": [[i % 4, (i // 4) % 4, i % 5, i] for i in ids], "attributes": [[] for _ in ids]},
        schema={"item_id": pl.Int64, "sid": pl.List(pl.Int64), "attributes": pl.List(pl.Int64)},
    )


def _lists(n: int, seed: int) -> list[List]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        cands = rng.sample(range(1, N_ITEMS + 1), K)
        j = rng.randrange(K)
        ev = [[rng.randrange(TOP)] for _ in range(K)]
        ev[j] = [TOP]
        out.append(([rng.randrange(1, N_ITEMS + 1)], cands, ev, cands[j]))
    return out


def _fmt(answer_first: bool) -> FormatConfig:
    return FormatConfig(history_len=1, with_attributes=False, answer="index", answer_first=answer_first, evidence=("mark",), evidence_bins=((0.5, 1.5, 2.5),))


def _explanation(cands: list[int], first: int) -> list[str]:
    return ["pick", pos_token(cands.index(first) + 1), "because", "strong"]


def _train(answer_first: bool) -> tuple[torch.nn.Module, object, ItemText, FormatConfig]:
    table = _items()
    items, fmt = ItemText(table), _fmt(answer_first)
    tok = build_tokenizer(table, WORDS, max_sid_code=N_ITEMS, max_evidence=TOP + 1)
    train = [
        (build_prompt(h, c, items, fmt, ev), build_response(_explanation(c, t), [t, *[x for x in c if x != t]], items, fmt=fmt, candidates=c))
        for h, c, ev, t in _lists(400, seed=0)
    ]
    torch.manual_seed(0)
    cfg = SFTConfig(epochs=8, batch_size=16, lr=3e-3, warmup_steps=10)
    return train_sft(tiny_model(tok, config=TOY), tok, train, cfg).model, tok, items, fmt


def _decode(model, tok, items: ItemText, fmt: FormatConfig, lists: list[List], prefixes: list[str] | None = None) -> list[str]:
    """Greedy responses to `lists` (text, with the prefix), each forced to start with its prefix (none: free)."""
    sp = special_ids(tok)
    prefixes = prefixes or [""] * len(lists)
    prompts = [
        tok(build_prompt(h, c, items, fmt, ev) + (f" {p}" if p else ""), add_special_tokens=False)["input_ids"] for (h, c, ev, _), p in zip(lists, prefixes)
    ]
    out = ar_generate(model, prompts, pad_id=sp["pad"], eos_id=sp["eos"], max_new_tokens=60)
    return [" ".join(filter(None, [p, tok.decode(s)])) for s, p in zip(out.sequences, prefixes)]


def _parsed(texts: list[str], lists: list[List], items: ItemText, fmt: FormatConfig) -> list[ParsedResponse]:
    return [parse_response(t, c, items, fmt=fmt) for t, (_, c, _, _) in zip(texts, lists)]


def _first_written(texts: list[str], lists: list[List]) -> list[int | None]:
    """The first candidate each answer's recommendations name, as written (None: none), valid permutation or not."""
    out = []
    for text, (_, c, _, _) in zip(texts, lists):
        answer = text.split(RECOMMENDATIONS_KEY, 1)[1] if RECOMMENDATIONS_KEY in text else ""
        m = POSITION_RE.search(answer)
        out.append(c[int(m.group(1)) - 1] if m and int(m.group(1)) <= len(c) else None)
    return out


def _top1(parsed: list[ParsedResponse], wanted: list[int]) -> float:
    return sum(p.valid_permutation and p.ranking[0] == w for p, w in zip(parsed, wanted)) / len(wanted)


@pytest.mark.slow  # two trainings of ~30 s
def test_the_decision_inside_the_reasoning_is_learned_as_well_as_answer_first_and_carried() -> None:
    held_out = _lists(60, seed=2)
    marked = [t for *_, t in held_out]
    # Measured with this budget: 1.00 for both formats (chance 1/6); at half of it, both below 0.2.
    accuracy = {}
    for answer_first in (True, False):
        model, tok, items, fmt = _train(answer_first)
        accuracy[answer_first] = _top1(_parsed(_decode(model, tok, items, fmt, held_out), held_out, items, fmt), marked)
    assert accuracy[False] >= 0.9 and accuracy[False] >= accuracy[True] - 0.05, accuracy
    assert accuracy[True] >= 0.9, accuracy  # the toy is learnable rank-first too: the comparison is fair

    # Forced to cite another candidate inside its reasoning, the reasoning-first model answers with that one
    # first: its answer follows what its reasoning decided, not a decision taken elsewhere.
    # Measured: 0.85 of the answers name the forced candidate first, none the marked one.
    rng = random.Random(3)
    forced = [rng.choice([x for x in c if x != t]) for _, c, _, t in held_out]
    prefixes = [" ".join([*REASONING_FIRST_OPENING, "pick", pos_token(c.index(f) + 1)]) for (_, c, _, _), f in zip(held_out, forced)]
    firsts = _first_written(_decode(model, tok, items, fmt, held_out, prefixes), held_out)
    assert sum(f == w for f, w in zip(firsts, forced)) / len(forced) >= 0.7
    assert sum(f == w for f, w in zip(firsts, marked)) / len(marked) <= 0.1
