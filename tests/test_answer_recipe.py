"""The answer recipe on a toy re-ranking task: what a small from-scratch model can write.

The old recipe (answers as four semantic-id tokens per item, the order after the
promoted item sampled at random) asks the model to copy 4-token ids in an order
it cannot predict; on the default profile that gave repeats and ids mixed from
different items. The chosen recipe (`answer: index`, `rest_order: incoming`)
names each candidate by its incoming position (one token) and keeps the incoming
order after the promoted item. With the same model, data and training budget,
the chosen recipe writes valid permutations on held-out lists and the old one
does not. The strict parser (`parse_response`) is the judge.
"""

from __future__ import annotations

import random

import polars as pl
import pytest
from gr2model.decoding.ar_decode import ar_generate
from gr2model.task.rerank_format import FormatConfig, ItemText, build_prompt, build_response, parse_response
from gr2model.training.sft import SFTConfig, train_sft
from gr2model.task.tokenizer import build_tokenizer, special_ids

from tiny import TOY, tiny_model

N_ITEMS, K, HISTORY = 40, 6, 2
WORDS = ["because", "first"]


def _items() -> pl.DataFrame:
    """N_ITEMS items whose 4-level ids share prefixes, like real semantic ids."""
    ids = list(range(1, N_ITEMS + 1))
    return pl.DataFrame(
        {"item_id": ids, "sid": [[i % 4, (i // 4) % 4, i % 5, i] for i in ids], "attributes": [[] for _ in ids]},
        schema={"item_id": pl.Int64, "sid": pl.List(pl.Int64), "attributes": pl.List(pl.Int64)},
    )


def _lists(n: int, seed: int) -> list[tuple[list[int], list[int], int]]:
    """(history, candidates, target): the target is the candidate whose id is next after the last history item's, else the first."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        cands = rng.sample(range(1, N_ITEMS + 1), K)
        target = rng.choice(cands)
        history = [rng.randrange(1, N_ITEMS + 1) for _ in range(HISTORY - 1)] + [(target - 2) % N_ITEMS + 1]
        out.append((history, cands, target))
    return out


def _examples(lists, items: ItemText, fmt: FormatConfig, rest: str, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    pairs = []
    for history, cands, target in lists:
        others = [c for c in cands if c != target]
        if rest == "sampled":
            rng.shuffle(others)
        response = build_response(WORDS, [target, *others], items, fmt=fmt, candidates=cands)
        pairs.append((build_prompt(history, cands, items, fmt), response))
    return pairs


def _valid_permutation_rate(answer: str, rest: str) -> float:
    table = _items()
    items = ItemText(table)
    tok = build_tokenizer(table, WORDS, max_sid_code=N_ITEMS)
    fmt = FormatConfig(history_len=HISTORY, with_attributes=False, answer=answer)
    train = _examples(_lists(400, seed=0), items, fmt, rest, seed=1)
    held_out = _lists(40, seed=2)
    cfg = SFTConfig(epochs=12, batch_size=16, lr=3e-3, warmup_steps=10)
    model = train_sft(tiny_model(tok, config=TOY), tok, train, cfg).model
    sp = special_ids(tok)
    prompts = [tok(build_prompt(h, c, items, fmt), add_special_tokens=False)["input_ids"] for h, c, _ in held_out]
    out = ar_generate(model, prompts, pad_id=sp["pad"], eos_id=sp["eos"], max_new_tokens=80)
    parsed = [parse_response(tok.decode(s), c, items, fmt=fmt) for s, (_, c, _) in zip(out.sequences, held_out)]
    return sum(p.valid_permutation for p in parsed) / len(parsed)


@pytest.mark.slow  # ~35 s of training three recipes
def test_chosen_recipe_writes_valid_permutations_where_the_old_one_did_not() -> None:
    # Measured with this budget: index+incoming 1.0, sid+sampled 0.0, sid+incoming 0.0
    # ("out of set": ids mixed from different items), index+sampled (fewer epochs) ~0.
    assert _valid_permutation_rate("index", "incoming") >= 0.95
    assert _valid_permutation_rate("sid", "sampled") <= 0.2
