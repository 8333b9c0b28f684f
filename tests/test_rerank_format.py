"""The re-ranking text format: exact prompts and responses, the strict parser, the metrics."""

from __future__ import annotations

import json
from dataclasses import replace

import polars as pl
import pytest

from gr2model.task.rerank_format import (
    EOS,
    RERANK_METRIC_NAMES,
    FormatConfig,
    ItemText,
    ParsedResponse,
    build_full_text,
    build_prompt,
    build_response,
    no_reasoning_prefix,
    parse_response,
    rerank_metrics,
)


def make_items() -> pl.DataFrame:
    """Items 1..12: sid [i, 10 + i, 20 + i, i % 3] (item 12's d code is 300),
    attributes [i, i + 1, i + 2, i + 3] except item 2 (none)."""
    ids = list(range(1, 13))
    sids = [[i, 10 + i, 20 + i, 300 if i == 12 else i % 3] for i in ids]
    attrs = [[] if i == 2 else [i, i + 1, i + 2, i + 3] for i in ids]
    return pl.DataFrame(
        {"item_id": ids, "sid": sids, "attributes": attrs},
        schema={"item_id": pl.Int64, "sid": pl.List(pl.Int64), "attributes": pl.List(pl.Int64)},
    )


@pytest.fixture(scope="module")
def items() -> ItemText:
    return ItemText(make_items())


CANDS = [3, 5, 7, 9]


def sid(i: int) -> str:
    return f"<a_{i}> <b_{10 + i}> <c_{20 + i}> <d_{300 if i == 12 else i % 3}>"


def resp(recs: list[str], explanation: str = " looks good ") -> str:
    """A response with arbitrary recommendation strings, in the canonical spacing."""
    inner = " , ".join(f'" {r} "' for r in recs)
    return f'{{ "explanation" : "{explanation}" , "recommendations" : [ {inner} ] }}'


# ----------------------------------------------------------------------- items


def test_item_tokens(items: ItemText) -> None:
    assert items.sid_tokens(5) == ["<a_5>", "<b_15>", "<c_25>", "<d_2>"]
    assert items.sid_tokens(12)[-1] == "<d_300>"
    assert items.item_tokens(5, True, 3) == [
        "<a_5>", "<b_15>", "<c_25>", "<d_2>", "(", "<attr_5>", "<attr_6>", "<attr_7>", ")"
    ]
    assert items.item_tokens(5, True, 1) == ["<a_5>", "<b_15>", "<c_25>", "<d_2>", "(", "<attr_5>", ")"]
    # No attributes to write: no empty parentheses.
    assert items.item_tokens(5, False, 3) == items.sid_tokens(5)
    assert items.item_tokens(5, True, 0) == items.sid_tokens(5)
    assert items.item_tokens(2, True, 3) == items.sid_tokens(2)
    with pytest.raises(KeyError):
        items.sid_tokens(99)


def test_item_of_sid_is_whitespace_insensitive_and_strict(items: ItemText) -> None:
    assert items.item_of_sid(sid(7)) == 7
    assert items.item_of_sid("  <a_7><b_17>\n<c_27>   <d_1> ") == 7
    assert items.item_of_sid(sid(12)) == 12
    for bad in ["<a_7> <b_17> <c_27>", "<a_7> <b_17> <c_27> <d_1> <d_1>", "<b_7> <a_17> <c_27> <d_1>",
                "<a_07> <b_17> <c_27> <d_1>", "<a_7> <b_17> x <c_27> <d_1>", "", "<a_99> <b_0> <c_0> <d_0>"]:
        assert items.item_of_sid(bad) is None, bad


def test_item_text_rejects_ambiguous_or_malformed_ids() -> None:
    df = make_items()
    def with_sid_of_item_2(value: object) -> pl.DataFrame:
        return df.with_columns(
            sid=pl.when(pl.col("item_id") == 2).then(value).otherwise(pl.col("sid"))
        )

    with pytest.raises(ValueError, match="share"):
        ItemText(with_sid_of_item_2(pl.lit([1, 11, 21, 1])))  # item 1's id
    with pytest.raises(ValueError, match="4 codes"):
        ItemText(with_sid_of_item_2(pl.lit([1, 2, 3])))
    # Items without a semantic id are allowed until someone writes them.
    no_sid = ItemText(with_sid_of_item_2(None))
    assert 2 not in no_sid and 3 in no_sid and len(no_sid) == 11


# ---------------------------------------------------------------------- prompt


def test_prompt_exact_text(items: ItemText) -> None:
    p = build_prompt([1, 2, 4], [5, 3], items, FormatConfig(history_len=2, max_attributes=2))
    assert p == (
        "<|user|> history : <a_2> <b_12> <c_22> <d_2> "
        "<a_4> <b_14> <c_24> <d_1> ( <attr_4> <attr_5> ) "
        "candidates : <a_5> <b_15> <c_25> <d_2> ( <attr_5> <attr_6> ) "
        "<a_3> <b_13> <c_23> <d_0> ( <attr_3> <attr_4> ) <|assistant|>"
    )
    bare = build_prompt([1, 2, 4], [5, 3], items, FormatConfig(history_len=0, with_attributes=False))
    assert bare == "<|user|> history : candidates : " + sid(5) + " " + sid(3) + " <|assistant|>"
    # Default: the last 10 history items, single spaces everywhere.
    long = build_prompt(list(range(1, 13)), CANDS, items, FormatConfig(with_attributes=False))
    assert long.startswith("<|user|> history : " + sid(3) + " ")
    assert long.split(" ") == long.split()
    with pytest.raises(ValueError, match="distinct"):
        build_prompt([1], [3, 3], items, FormatConfig())


def test_format_config_validates() -> None:
    with pytest.raises(ValueError):
        FormatConfig(history_len=-1)
    with pytest.raises(ValueError):
        FormatConfig(max_attributes=-1)


# -------------------------------------------------------------------- response


def test_response_exact_text_and_json(items: ItemText) -> None:
    r = build_response(["user", "likes", "<a_3>", "<b_13>", "<c_23>", "<d_0>", "<attr_4>"], [5, 3], items)
    assert r == (
        '{ "explanation" : " user likes <a_3> <b_13> <c_23> <d_0> <attr_4> " , '
        '"recommendations" : [ " ' + sid(5) + ' " , " ' + sid(3) + ' " ] }'
    )
    obj = json.loads(r)
    assert list(obj) == ["explanation", "recommendations"]
    assert obj["recommendations"] == [f" {sid(5)} ", f" {sid(3)} "]
    assert json.loads(build_response([], [], items)) == {"explanation": " ", "recommendations": []}
    assert build_full_text("P", "R") == f"P R {EOS}"


@pytest.mark.parametrize("word", ["", "two words", 'qu"ote', "back\\slash", "<|eos|>", "x<|pad|>"])
def test_response_rejects_words_that_break_the_format(items: ItemText, word: str) -> None:
    with pytest.raises(ValueError):
        build_response(["ok", word], CANDS, items)


@pytest.mark.parametrize("ranking", [[9, 3, 7, 5], [3, 5, 7, 9], [5, 3, 9, 7]])
def test_valid_response_round_trips(items: ItemText, ranking: list[int]) -> None:
    words = ["the", "user", "buys", "<a_9>", "<b_19>", "<c_29>", "<d_0>", "often", ":", ","]
    text = build_response(words, ranking, items)
    for variant in [text, f"  {text} {EOS}", f"{text} {EOS} <|pad|> <|pad|>", f"\n{text}{EOS}\n"]:
        p = parse_response(variant, CANDS, items)
        assert p == ParsedResponse(True, True, ranking, " ".join(words), "", ranking == CANDS)


def test_parser_is_whitespace_tolerant_inside_json(items: ItemText) -> None:
    # What a BPE tokenizer's decode may produce: glued ids, other spacing.
    text = (
        '{"explanation":"a   b\\n likes<a_9><b_19> <c_29><d_0>(<attr_2>)",'
        '"recommendations":["<a_9><b_19><c_29><d_0>","  <a_3> <b_13><c_23> <d_0>",'
        f'"{sid(5)}","{sid(7)}"]}}<|eos|>'
    )
    p = parse_response(text, CANDS, items)
    assert p.valid_permutation and p.ranking == [9, 3, 5, 7]
    # The explanation comes back in canonical spacing.
    assert p.explanation == "a b likes <a_9> <b_19> <c_29> <d_0> ( <attr_2> )"


INVALID = {
    "empty": ("", "not json", False),
    "plain text": ("the best is item 3", "not json", False),
    "truncated": (resp([sid(i) for i in CANDS])[:-3], "not json", False),
    "trailing garbage": (resp([sid(i) for i in CANDS]) + " }", "not json", False),
    "text before the json": ("hello " + resp([sid(i) for i in CANDS]), "not json", False),
    "not an object": ('[ " ' + sid(3) + ' " ]', "not an object", False),
    "missing recommendations": ('{ "explanation" : " x " }', "missing key", False),
    "missing explanation": ('{ "recommendations" : [ ] }', "missing key", False),
    "extra key": ('{ "explanation" : " x " , "recommendations" : [ ] , "score" : 1 }', "extra key", False),
    "duplicate key": (
        '{ "explanation" : " x " , "explanation" : " y " , "recommendations" : [ ] }', "duplicate key", False
    ),
    "explanation not a string": ('{ "explanation" : 3 , "recommendations" : [ ] }', "not a string", False),
    "recommendations not a list": (
        '{ "explanation" : " x " , "recommendations" : " ' + sid(3) + ' " }', "not a list", False
    ),
    "recommendation not a string": (resp([sid(3), sid(5), sid(7)])[:-4] + ", 9 ] }", "not a string", False),
    "three-token id": (resp([sid(3), sid(5), sid(7), "<a_9> <b_19> <c_29>"]), "bad id", False),
    "five-token id": (resp([sid(3), sid(5), sid(7), sid(9) + " <a_1>"]), "bad id", False),
    "levels out of order": (resp([sid(3), sid(5), sid(7), "<b_19> <a_9> <c_29> <d_0>"]), "bad id", False),
    "leading zero": (resp([sid(3), sid(5), sid(7), "<a_09> <b_19> <c_29> <d_0>"]), "bad id", False),
    "word inside id": (resp([sid(3), sid(5), sid(7), "item <a_9> <b_19> <c_29> <d_0>"]), "bad id", False),
    "item not among candidates": (resp([sid(3), sid(5), sid(7), sid(11)]), "out of set", True),
    "unknown id": (resp([sid(3), sid(5), sid(7), "<a_200> <b_0> <c_0> <d_0>"]), "out of set", True),
    "duplicate": (resp([sid(3), sid(5), sid(5), sid(9)]), "duplicate", True),
    "duplicate, short": (resp([sid(3), sid(3), sid(9)]), "duplicate", True),
    "missing candidate": (resp([sid(3), sid(5), sid(9)]), "missing candidate", True),
    "empty ranking": (resp([]), "missing candidate", True),
    "too many": (resp([sid(3), sid(5), sid(7), sid(9), sid(3)]), "too many", True),
}


@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_responses_fall_back_to_incoming_order(items: ItemText, name: str) -> None:
    text, error, valid_format = INVALID[name]
    p = parse_response(text, CANDS, items)
    assert p.error == error
    assert p.valid_format is valid_format
    assert not p.valid_permutation and not p.copies_incoming
    assert p.ranking == CANDS


def test_parser_rejects_duplicate_candidates(items: ItemText) -> None:
    with pytest.raises(ValueError, match="distinct"):
        parse_response(resp([sid(3)]), [3, 3], items)


# --------------------------------------------------------------------- metrics


def test_rerank_metrics_hand_example(items: ItemText) -> None:
    def judged(ranking: list[int]) -> ParsedResponse:
        return parse_response(build_response(["x"], ranking, items), CANDS, items)

    parsed = [
        judged([9, 3, 5, 7]),  # target 9 moved to first: rank 0
        judged([3, 5, 7, 9]),  # copy of the incoming order, target 5: rank 1
        parse_response("garbage", CANDS, items),  # fallback to incoming, target 7: rank 2
        judged([3, 5, 5, 9]),  # valid format, not a permutation; fallback, target 9: rank 3
    ]
    m = rerank_metrics(parsed, [9, 5, 7, 9])
    assert list(m) == list(RERANK_METRIC_NAMES) == [
        "recall@1", "recall@3", "recall@5", "ndcg@3", "ndcg@5",
        "valid_format_rate", "valid_permutation_rate", "copy_incoming_rate", "n",
    ]
    import math

    assert m["recall@1"] == pytest.approx(0.25)
    assert m["recall@3"] == pytest.approx(0.75)
    assert m["recall@5"] == pytest.approx(1.0)
    assert m["ndcg@3"] == pytest.approx((1 + 1 / math.log2(3) + 1 / math.log2(4)) / 4)
    assert m["ndcg@5"] == pytest.approx((1 + 1 / math.log2(3) + 1 / math.log2(4) + 1 / math.log2(5)) / 4)
    assert m["valid_format_rate"] == pytest.approx(0.75)
    assert m["valid_permutation_rate"] == pytest.approx(0.5)
    assert m["copy_incoming_rate"] == pytest.approx(0.25)
    assert m["n"] == 4


def test_rerank_metrics_empty_and_mismatch() -> None:
    m = rerank_metrics([], [])
    assert m["n"] == 0 and all(v == 0 for v in m.values())
    with pytest.raises(ValueError):
        rerank_metrics([], [1])


# ------------------------------------------------------------ index answer format

INDEX = FormatConfig(history_len=2, with_attributes=False, answer="index")


def test_index_prompt_numbers_the_candidates(items: ItemText) -> None:
    p = build_prompt([1, 2], [5, 3], items, INDEX)
    assert p == f"<|user|> history : {sid(1)} {sid(2)} candidates : <pos_1> {sid(5)} <pos_2> {sid(3)} <|assistant|>"


@pytest.mark.parametrize("ranking", [[9, 3, 7, 5], [3, 5, 7, 9], [5, 3, 9, 7]])
def test_index_response_round_trips(items: ItemText, ranking: list[int]) -> None:
    words = ["first", "<a_9>", "<b_19>", "<c_29>", "<d_0>", "because"]
    text = build_response(words, ranking, items, fmt=INDEX, candidates=CANDS)
    positions = [CANDS.index(r) + 1 for r in ranking]
    assert json.loads(text)["recommendations"] == [f" <pos_{k}> " for k in positions]
    p = parse_response(f"{text} {EOS}", CANDS, items, fmt=INDEX)
    assert p == ParsedResponse(True, True, ranking, " ".join(words), "", ranking == CANDS)
    # The same text judged as the sid format is not a well-formed answer.
    assert parse_response(text, CANDS, items).error == "bad id"


@pytest.mark.parametrize("answer", ["index", "sid"])
@pytest.mark.parametrize("ranking", [[9, 3, 7, 5], [3, 5, 7, 9]])
def test_answer_first_response_round_trips(items: ItemText, answer: str, ranking: list[int]) -> None:
    fmt = FormatConfig(history_len=2, with_attributes=False, answer=answer, answer_first=True)
    words = ["first", "<a_9>", "<b_19>", "<c_29>", "<d_0>", "because"]
    text = build_response(words, ranking, items, fmt=fmt, candidates=CANDS)
    # The decision comes right after the opening brace; the explanation follows it.
    assert text.startswith('{ "recommendations" : [ "')
    assert text.endswith('"explanation" : " first <a_9> <b_19> <c_29> <d_0> because " }')
    assert list(json.loads(text)) == ["recommendations", "explanation"]
    p = parse_response(f"{text} {EOS}", CANDS, items, fmt=fmt)
    assert p == ParsedResponse(True, True, ranking, " ".join(words), "", ranking == CANDS)
    # The same ranking and words in the paper's order parse to the same answer.
    plain = build_response(words, ranking, items, fmt=replace(fmt, answer_first=False), candidates=CANDS)
    assert plain != text and parse_response(plain, CANDS, items, fmt=fmt) == p


@pytest.mark.parametrize(
    "recs, error, valid_format",
    [
        (["<pos_1>", "<pos_2>", "<pos_3>", "<pos_5>"], "out of set", True),  # K = 4
        (["<pos_1>", "<pos_1>", "<pos_2>", "<pos_3>"], "duplicate", True),
        (["<pos_1>", "<pos_2>", "<pos_3>"], "missing candidate", True),
        (["<pos_1>", "<pos_2>", "<pos_3>", "<pos_4>", "<pos_1>"], "too many", True),
        (["<pos_0>", "<pos_2>", "<pos_3>", "<pos_4>"], "bad id", False),
        (["<pos_01>", "<pos_2>", "<pos_3>", "<pos_4>"], "bad id", False),
        ([sid(3), "<pos_2>", "<pos_3>", "<pos_4>"], "bad id", False),
    ],
)
def test_index_parser_is_strict(items: ItemText, recs: list[str], error: str, valid_format: bool) -> None:
    p = parse_response(resp(recs), CANDS, items, fmt=INDEX)
    assert (p.error, p.valid_format, p.valid_permutation, p.ranking) == (error, valid_format, False, CANDS)


def test_index_response_needs_the_candidates(items: ItemText) -> None:
    with pytest.raises(ValueError, match="candidates"):
        build_response(["x"], [3, 5], items, fmt=INDEX)
    with pytest.raises(ValueError, match="not a candidate"):
        build_response(["x"], [3, 4], items, fmt=INDEX, candidates=[3, 5])
    with pytest.raises(ValueError, match="answer"):
        FormatConfig(answer="json")


# ----------------------------------------------------------------------- evidence

EV_FMT = FormatConfig(answer="index", with_attributes=False, evidence=("co", "score"), evidence_bins=((0.0, 1.0), (-1.0,)))


def test_evidence_prompt_exact_text(items: ItemText) -> None:
    # Each candidate's evidence levels come right after its position token, one token per feature.
    p = build_prompt([1], [3, 5], items, EV_FMT, evidence=[[2, 0], [0, 1]])
    assert p == (
        "<|user|> history : <a_1> <b_11> <c_21> <d_1> candidates : "
        "<pos_1> <ev1_2> <ev2_0> <a_3> <b_13> <c_23> <d_0> <pos_2> <ev1_0> <ev2_1> <a_5> <b_15> <c_25> <d_2> <|assistant|>"
    )
    # Without evidence in the format the prompt is the old one, and evidence is refused.
    plain = FormatConfig(answer="index", with_attributes=False)
    assert "<ev" not in build_prompt([1], [3, 5], items, plain)
    with pytest.raises(ValueError, match="writes none"):
        build_prompt([1], [3, 5], items, plain, evidence=[[0, 0], [0, 0]])


@pytest.mark.parametrize("evidence", [None, [[0, 0]], [[0], [0]], [[0, 0], [0, 8]]])
def test_evidence_prompt_rejects_missing_or_malformed_levels(items: ItemText, evidence) -> None:
    with pytest.raises(ValueError):
        build_prompt([1], [3, 5], items, EV_FMT, evidence=evidence)


def test_evidence_format_round_trips_through_json_and_validates() -> None:
    from dataclasses import asdict

    again = FormatConfig(**json.loads(json.dumps(asdict(EV_FMT))))
    assert again == EV_FMT and again.evidence_bins == ((0.0, 1.0), (-1.0,))
    with pytest.raises(ValueError, match="threshold lists"):
        FormatConfig(evidence=("co",))
    with pytest.raises(ValueError, match="ascending"):
        FormatConfig(evidence=("co",), evidence_bins=((1.0, 0.0),))
    with pytest.raises(ValueError, match="repeated"):
        FormatConfig(evidence=("co", "co"), evidence_bins=((), ()))


def test_evidence_levels_and_fitted_bins() -> None:
    import numpy as np

    from gr2model.task.rerank_format import EVIDENCE_LEVELS, evidence_levels, fit_evidence_bins

    rng = np.random.default_rng(0)
    # Feature 0: continuous, cut into EVIDENCE_LEVELS levels of equal mass; feature 1:
    # zero for 80% of the candidates: the zeros get a level of their own.
    values = [np.stack([rng.normal(size=10), np.where(rng.random(10) < 0.8, 0.0, rng.random(10) + 1)], axis=1) for _ in range(400)]
    bins = fit_evidence_bins(values)
    assert len(bins[0]) == EVIDENCE_LEVELS - 1 and len(bins[1]) == EVIDENCE_LEVELS - 1
    levels = np.concatenate([evidence_levels(v, bins) for v in values])
    counts = np.bincount(levels[:, 0], minlength=EVIDENCE_LEVELS)
    assert counts.min() > 0.8 * len(levels) / EVIDENCE_LEVELS
    zeros = np.concatenate(values)[:, 1] == 0
    assert len(set(levels[zeros, 1])) == 1 and levels[~zeros, 1].min() > levels[zeros, 1][0]
    assert evidence_levels(np.array([[bins[0][0], 0.0]]), bins)[0, 0] == 1  # a threshold reached counts
    with pytest.raises(ValueError, match="shape"):
        evidence_levels(np.zeros((3, 1)), bins)


@pytest.mark.parametrize("ranking", [[9, 3, 7, 5], [3, 5, 7, 9]])
def test_reasoning_first_response_with_position_citations_round_trips(items: ItemText, ranking: list[int]) -> None:
    """The default format: the explanation first, citing candidates as `<pos_k>` + semantic id in the
    order it ranks them, then the ranking that follows from it."""
    fmt = FormatConfig(history_len=2, with_attributes=False, answer="index", answer_first=False)
    cited = [w for r in ranking[:2] for w in (f"<pos_{CANDS.index(r) + 1}>", *sid(r).split(), "then")]
    words = ["step", "2", ":", *cited]
    text = build_response(words, ranking, items, fmt=fmt, candidates=CANDS)
    assert text.startswith('{ "explanation" : " step 2 : <pos_')
    assert list(json.loads(text)) == ["explanation", "recommendations"]
    p = parse_response(f"{text} {EOS}", CANDS, items, fmt=fmt)
    assert p == ParsedResponse(True, True, ranking, " ".join(words), "", ranking == CANDS)
    # The reasoning's citations name the answer's first two positions, token for token.
    positions = [w for w in p.explanation.split() if w.startswith("<pos_")]
    assert positions == [f"<pos_{CANDS.index(r) + 1}>" for r in ranking[:2]]
    assert json.loads(text)["recommendations"][:2] == [f" {w} " for w in positions]
    # A BPE-style decode that glues the citation to its id still reads the same explanation.
    glued = text.replace(f"{positions[0]} <a_", f"{positions[0]}<a_", 1)
    assert parse_response(glued, CANDS, items, fmt=fmt).explanation == p.explanation


def test_no_reasoning_prefix_opens_an_empty_explanation(items: ItemText) -> None:
    fmt = FormatConfig(answer="index", answer_first=False)
    prefix = no_reasoning_prefix(fmt)
    assert prefix == '{ "explanation" : " " ,'
    # What the model writes after it completes a response whose explanation is empty.
    rest = build_response([], [5, 3, 7, 9], items, fmt=fmt, candidates=CANDS)[len(prefix) :]
    p = parse_response(prefix + rest, CANDS, items, fmt=fmt)
    assert p.valid_permutation and p.explanation == "" and p.ranking == [5, 3, 7, 9]
    with pytest.raises(ValueError, match="answer-first"):
        no_reasoning_prefix(replace(fmt, answer_first=True))
