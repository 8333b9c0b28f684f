"""Speculative decoding wired into the decode benchmark and the evaluation: rows, counts, equality with GR2."""

from __future__ import annotations

import polars as pl
import pytest

from gr2model.bench import SPEC_FIELDS, decode_benchmark, speed_table
from gr2model.block_diffusion import convert_to_block_diffusion
from gr2model.rerank_format import FormatConfig

from tiny import TOY_CANDIDATES, randomize, toy_items, toy_model, toy_tokenizer

FMT = FormatConfig(history_len=1, with_attributes=False)


@pytest.fixture(scope="module")
def setup():
    tok = toy_tokenizer()
    # Random weights of a larger scale: confident, varied tokens (no near-ties), so
    # equal outputs mean something.
    ar = randomize(toy_model(tok), 0.3).eval()
    dgr2 = convert_to_block_diffusion(ar, tok, block_size=4).eval()
    other = randomize(convert_to_block_diffusion(ar, tok, block_size=4), 0.3, seed=7).eval()  # a poor drafter
    lists = pl.DataFrame(
        {"history": [[], [1], [2], [3]], "candidates": [list(c) for c in TOY_CANDIDATES[:4]], "target": [1, 2, 3, 4]}
    )
    return tok, ar, dgr2, other, lists


def test_benchmark_spec_rows(setup) -> None:
    tok, ar, dgr2, other, lists = setup
    rows = decode_benchmark(
        ar, {"d": dgr2}, tok, lists, toy_items(), FMT, taus=[0.9], batch_sizes=[1, 2], max_new_tokens=12,
        drafters={"d": dgr2, "bad": other}, draft_len=3, draft_steps=2,
    )  # fmt: skip
    assert [(r["decoder"], r["model"], r["batch_size"]) for r in rows] == [
        (d, m, b) for b in (1, 2) for d, m in (("ar", "gr2"), ("hf", "gr2"), ("diffusion", "d"), ("spec", "d"), ("spec", "bad"))
    ]
    for r in rows:
        if r["decoder"] != "spec":
            assert all(r[f] is None for f in SPEC_FIELDS)
            continue
        ar_row = next(a for a in rows if a["decoder"] == "ar" and a["batch_size"] == r["batch_size"])
        assert r["equal_to_gr2"] == 1.0
        # GR2's own answers: the same length and accuracy as the AR row.
        assert r["response_tokens"] == ar_row["response_tokens"] and r["n"] == ar_row["n"] == 4
        assert r["recall@1"] == ar_row["recall@1"] and r["valid_format_rate"] == ar_row["valid_format_rate"]
        assert (r["draft_len"], r["draft_steps"], r["tau"]) == (3, 2, None)
        assert 0.0 <= r["mean_accepted_length"] <= 3
        assert r["ar_forwards_per_token"] + r["draft_forwards_per_token"] == pytest.approx(r["nfe_per_token"])
        assert r["ar_forwards_per_token"] > 0 and r["draft_forwards_per_token"] > 0
        assert r["speedup"] == r["speedup"] and r["tokens_per_s"] > 0  # measured, not NaN
    spec = {(r["model"], r["batch_size"]): r for r in rows if r["decoder"] == "spec"}
    # The converted GR2 drafts GR2's tokens better than a random network does.
    assert spec[("d", 1)]["mean_accepted_length"] > spec[("bad", 1)]["mean_accepted_length"]
    table = speed_table(rows)
    assert "| equal_to_gr2 |" in table.splitlines()[0] and "mean_accepted_length" in table
    assert "equal_to_gr2" not in speed_table([r for r in rows if r["decoder"] != "spec"])
    with pytest.raises(ValueError):
        decode_benchmark(ar, {}, tok, lists, toy_items(), FMT, taus=[0.9], batch_sizes=[1], max_new_tokens=4, drafters={"d": dgr2}, draft_len=0)
