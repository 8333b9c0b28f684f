"""Property-based tests (hypothesis) of what comes from outside, which must be refused with a clear
error rather than crash: answers, requests, data files.

- `parse_response`: never raises on any text; round-trips with `build_response`;
  rejects every duplicate, drop and out-of-set id (falling back to the incoming order).
- `validate_rerank_input` / `validate_rerank_evidence`: any JSON value gets a
  400 (naming the row and field when the request has rows), never another exception.
- the data loaders: random corruptions of a small sequence file (and of a raw
  review dump) end in a `DataError` naming the file and line, with nothing written.

Derandomized, no example database, modest example counts: each test runs in a few seconds.
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gr2model.task.rerank_format import EOS, FormatConfig, ItemText, build_response, parse_response

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])

# Items 1..12 with semantic ids [i, 10+i, 20+i, i % 3]; 13 has none (never in a valid answer).
ITEMS = ItemText(
    pl.DataFrame(
        {"item_id": list(range(1, 14)), "sid": [[i, 10 + i, 20 + i, i % 3] for i in range(1, 13)] + [None], "attributes": [[i] for i in range(1, 14)]},
        schema={"item_id": pl.Int64, "sid": pl.List(pl.Int64), "attributes": pl.List(pl.Int64)},
    )
)
FORMATS = [None, FormatConfig(answer="index"), FormatConfig(answer_first=True), FormatConfig(answer="index", answer_first=True)]
PERMUTATION_ERRORS = {"out of set", "too many", "duplicate", "missing candidate"}

# A word the response builder accepts: no whitespace, quote, backslash, control character or special token.
words = st.text(st.characters(blacklist_categories=("Cs", "Cc", "Zs", "Zl", "Zp"), blacklist_characters='"\\|\x85\xa0'), min_size=1, max_size=8).filter(
    lambda w: not any(c.isspace() for c in w)
)


@st.composite
def candidates_and_ranking(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """(K distinct candidates from the items with ids, a permutation of them), K in 2..6."""
    cands = draw(st.lists(st.integers(1, 12), min_size=2, max_size=6, unique=True))
    return cands, draw(st.permutations(cands))


def _judged_invalid(text: str, cands: list[int], fmt: FormatConfig | None) -> str:
    parsed = parse_response(text, cands, ITEMS, fmt=fmt)
    assert not parsed.valid_permutation and not parsed.copies_incoming
    assert parsed.ranking == cands  # the fallback: the incoming order
    return parsed.error


@SETTINGS
@given(text=st.text(max_size=300), cands=st.lists(st.integers(1, 13), min_size=1, max_size=6, unique=True), fmt=st.sampled_from(FORMATS))
@example(text='{"explanation": "", "recommendations": ["<pos_' + "9" * 5000 + '>"]}', cands=[1, 2], fmt=FORMATS[1])
@example(text='{"explanation": "", "recommendations": ["<a_' + "1" * 5000 + '> <b_1> <c_1> <d_1>"]}', cands=[1, 2], fmt=None)
@example(text="1" * 5000, cands=[1, 2], fmt=None)
@example(text="[" * 100_000, cands=[1, 2], fmt=None)
@example(text='{"explanation": "x", "recommendations": [' + '"<pos_1>",' * 3 + "]" * 1 + "}", cands=[1, 2], fmt=FORMATS[1])
def test_parse_response_never_raises(text: str, cands: list[int], fmt: FormatConfig | None) -> None:
    parsed = parse_response(text, cands, ITEMS, fmt=fmt)
    assert parsed.valid_permutation == (parsed.error == "")
    if not parsed.valid_permutation:
        assert parsed.ranking == cands
    else:
        assert sorted(parsed.ranking) == sorted(cands)


@st.composite
def near_valid(draw: st.DrawFn) -> str:
    """A valid response with a few characters inserted, deleted or replaced: mostly almost-JSON."""
    cands, ranking = draw(candidates_and_ranking())
    text = build_response(draw(st.lists(words, max_size=5)), ranking, ITEMS)
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        ch = draw(st.sampled_from(list('{}[]:,"\\ <>_abcdpos0123456789|') + ["<|eos|>", "\x00", "\u2028", "é"]))
        text = text[:i] + (ch if op != "delete" else "") + text[i + (op != "insert") :]
    return text


@SETTINGS
@given(text=near_valid(), fmt=st.sampled_from(FORMATS))
def test_parse_response_never_raises_on_near_valid_text(text: str, fmt: FormatConfig | None) -> None:
    parsed = parse_response(text, [1, 2, 3], ITEMS, fmt=fmt)
    assert parsed.valid_permutation == (parsed.error == "")


@SETTINGS
@given(cr=candidates_and_ranking(), expl=st.lists(words, max_size=6), fmt=st.sampled_from(FORMATS), eos=st.booleans())
def test_build_then_parse_round_trips(cr: tuple[list[int], list[int]], expl: list[str], fmt: FormatConfig | None, eos: bool) -> None:
    cands, ranking = cr
    text = build_response(expl, ranking, ITEMS, fmt=fmt, candidates=cands)
    parsed = parse_response(text + (f" {EOS} <pad> junk" if eos else ""), cands, ITEMS, fmt=fmt)
    assert parsed.valid_format and parsed.valid_permutation and parsed.error == ""
    assert parsed.ranking == ranking and parsed.copies_incoming == (ranking == cands)
    assert parsed.explanation == " ".join(" ".join(expl).split())


@SETTINGS
@given(cr=candidates_and_ranking(), fmt=st.sampled_from(FORMATS), data=st.data())
def test_every_duplicate_drop_and_out_of_set_id_is_rejected(cr: tuple[list[int], list[int]], fmt: FormatConfig | None, data: st.DataObject) -> None:
    cands, ranking = cr
    index = fmt is not None and fmt.answer == "index"
    i = data.draw(st.integers(0, len(ranking) - 1), label="position")
    j = data.draw(st.integers(0, len(ranking) - 1).filter(lambda j: j != i), label="other position")

    def build(r: list[int]) -> str:
        return build_response(["why"], r, ITEMS, fmt=fmt, candidates=cands)

    # duplicate: one entry replaced by another candidate (K entries, one repeated)
    dup = ranking.copy()
    dup[i] = ranking[j]
    assert _judged_invalid(build(dup), cands, fmt) == "duplicate"
    # duplicate appended: K + 1 entries
    assert _judged_invalid(build([*ranking, ranking[i]]), cands, fmt) == "too many"
    # drop
    assert _judged_invalid(build(ranking[:i] + ranking[i + 1 :]), cands, fmt) == "missing candidate"
    # out of set: an item with an id that is not a candidate, or (index) a position past K
    if index:
        text = build(ranking).replace(f"<pos_{cands.index(ranking[i]) + 1}>", f"<pos_{len(cands) + data.draw(st.integers(1, 40))}>")
    else:
        outsider = data.draw(st.sampled_from(sorted(set(range(1, 13)) - set(cands))))
        text = build([*ranking[:i], outsider, *ranking[i + 1 :]])
    assert _judged_invalid(text, cands, fmt) == "out of set"
    # a well-formed sid that no item has (sid format) is out of set too
    if not index:
        assert _judged_invalid(build(ranking).replace(" ".join(ITEMS.sid_tokens(ranking[i])), "<a_99> <b_99> <c_99> <d_99>"), cands, fmt) == "out of set"


# --- requests -------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=25,
)
field_values = json_values | st.lists(st.integers(-5, 120), max_size=12) | st.lists(st.integers(1, 100), min_size=10, max_size=10, unique=True)
rows = st.lists(
    st.fixed_dictionaries({}, optional={"history": field_values, "candidates": field_values, "evidence": json_values, "extra": json_values}),
    max_size=4,
)
KNOWN = set(range(1, 101))


def _check_request(model_input: Any) -> None:
    from mlflow.exceptions import MlflowException

    from flows.registry import validate_rerank_evidence, validate_rerank_input

    try:
        histories, cands = validate_rerank_input(model_input, KNOWN, 10)
        validate_rerank_evidence(model_input, cands, 2)
    except MlflowException as exc:
        assert exc.get_http_status_code() == 400, exc.message
        rowlike = isinstance(model_input, list) and model_input and all(isinstance(r, dict) and {"history", "candidates"} <= set(r) and set(r) <= {"history", "candidates", "evidence"} for r in model_input)
        if rowlike and len(model_input) <= 256:
            # Every problem of a well-shaped request names its row and field.
            # Problems are joined by "; " and may hold "; " themselves: split where the next names a row.
            for problem in re.split(r"; (?=row \d+: |\.\.\. and )", exc.message.removeprefix("invalid re-ranking request: ")):
                if not problem.startswith("... and "):
                    assert problem.startswith("row ") and any(f": {f}:" in problem for f in ("history", "candidates", "evidence")), problem
        return
    for h, c in zip(histories, cands, strict=True):
        assert h and set(h) <= KNOWN and len(c) == 10 and len(set(c)) == 10 and set(c) <= KNOWN


@SETTINGS
@given(value=json_values | rows | st.dictionaries(st.sampled_from(["history", "candidates", "evidence"]), json_values, max_size=3))
@example(value={"history": {"a": 1}, "candidates": {"a": 2}})
@example(value=[{"history": [1], "candidates": list(range(1, 20_001))}])
@example(value=[{"history": [1], "candidates": list(range(1, 11)), "evidence": [[1, 2], [3, [4]]] + [[0, 0]] * 8}])
def test_any_json_request_gets_a_400_or_passes(value: Any) -> None:
    _check_request(value)


@SETTINGS
@given(records=rows.filter(bool))
def test_any_dataframe_request_gets_a_400_or_passes(records: list[dict[str, Any]]) -> None:
    """What MLflow hands the model for `dataframe_records`: a DataFrame, missing values as None/NaN."""
    import pandas as pd

    try:
        frame = pd.DataFrame(records)
    except Exception:  # pandas refuses the value itself: MLflow answers that before the model runs
        return
    _check_request(frame)


# --- data files -----------------------------------------------------------------------------

USERS = {u: [((u * 7 + k * 3) % 20) + 1 for k in range(5)] for u in range(1, 7)}
SEQ = "".join(f"{u} {' '.join(map(str, items))}\n" for u, items in USERS.items())
ITEM_IDS = sorted({i for items in USERS.values() for i in items})


def _write_dataset(d: Path, seq: bytes) -> None:
    (d / "Beauty.txt").write_bytes(seq)
    (d / "Beauty_item2attributes.json").write_text(json.dumps({str(i): [i, i + 1] for i in ITEM_IDS}))
    (d / "Beauty_item2sid_rqvae.json").write_text(json.dumps({str(i): [i, i % 4, i % 5, i % 7] for i in ITEM_IDS}))


def _prepare(d: Path) -> None:
    from tasks.prepare import PrepareConfig, run
    from tasks.tracking import StageTracker

    run(PrepareConfig(data_dir=str(d / "raw"), format="sequence"), d, logging.getLogger("fuzz"), StageTracker(None))


@st.composite
def corrupted_sequences(draw: st.DrawFn) -> tuple[bytes, bool]:
    """(the sequence file with one corruption, whether it must be refused).

    Structured corruptions always break it; random byte edits may leave a valid file.
    """
    lines = SEQ.splitlines(keepends=True)
    n = draw(st.integers(0, len(lines) - 1))
    kind = draw(st.sampled_from(["token", "zero", "negative", "huge", "duplicate user", "short", "unknown item", "bytes"]))
    toks = lines[n].split()
    k = draw(st.integers(1, len(toks) - 1))
    if kind == "token":
        toks[k] = draw(st.text(st.characters(blacklist_categories=("Cs", "Zs", "Cc", "Zl", "Zp")), min_size=1, max_size=6).filter(lambda t: not t.lstrip("+-").isdigit() and not any(c.isspace() for c in t)))
    elif kind == "zero":
        toks[k] = "0"
    elif kind == "negative":
        toks[k] = f"-{draw(st.integers(1, 10**30))}"
    elif kind == "huge":
        toks[k] = str(draw(st.integers(2**63, 10**40)))
    elif kind == "duplicate user":
        lines.insert(draw(st.integers(0, len(lines))), lines[n])
    elif kind == "short":
        toks = toks[: draw(st.integers(1, 3))]
    elif kind == "unknown item":
        toks[k] = str(draw(st.integers(21, 10**6)))
    if kind not in ("duplicate user", "bytes"):
        lines[n] = " ".join(toks) + "\n"
    raw = "".join(lines).encode()
    if kind == "bytes":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(raw)))
            raw = raw[:i] + draw(st.binary(min_size=1, max_size=3)) + raw[i + draw(st.integers(0, 2)) :]
    return raw, kind != "bytes"


@settings(max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=corrupted_sequences())
@example(case=(SEQ.replace("\n", "\x0c", 1).encode(), True))  # a form feed is no line break to an editor
@example(case=(SEQ.replace("\n", "\x85", 2).encode(), True))
@example(case=(b"\x1f\x8b" + SEQ.encode(), True))  # gzip magic on plain text
def test_corrupted_sequence_file_ends_in_a_data_error_naming_file_and_line(case: tuple[bytes, bool]) -> None:
    from gr2model.data.dataset import DataError

    raw, must_fail = case
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "raw").mkdir()
        _write_dataset(root / "raw", raw)
        try:
            _prepare(root)
        except DataError as exc:
            msg = str(exc)
            assert msg.startswith(("Beauty.txt", "Beauty_item2attributes.json", "Beauty_item2sid_rqvae.json")), msg
            assert " line" in msg, msg
            assert not (root / "data").exists() and not (root / "metrics").exists(), "outputs written despite the error"
            if " line " in msg and msg.startswith("Beauty.txt line "):
                # The named line is the line an editor shows (counting \n only).
                line_no = int(msg.split(" line ")[1].split(":")[0])
                assert 1 <= line_no <= raw.count(b"\n") + 1
            return
        assert not must_fail, "a corrupted file was accepted"
        assert (root / "data/prepared").is_dir()


def _review(user: str, asin: str, t: int) -> str:
    return json.dumps({"reviewerID": user, "asin": asin, "unixReviewTime": t})


REVIEWS = "".join(_review(f"U{u}", f"A{(u * 3 + k) % 8}", 1000 + k) + "\n" for u in range(6) for k in range(5))


@st.composite
def corrupted_reviews(draw: st.DrawFn) -> bytes:
    lines = REVIEWS.splitlines(keepends=True)
    n = draw(st.integers(0, len(lines) - 1))
    kind = draw(st.sampled_from(["field", "type", "huge", "nested", "truncate", "not object"]))
    rec = json.loads(lines[n])
    if kind == "field":
        del rec[draw(st.sampled_from(sorted(rec)))]
    elif kind == "type":
        rec[draw(st.sampled_from(sorted(rec)))] = draw(json_values.filter(lambda v: not isinstance(v, str)))
        if isinstance(rec["unixReviewTime"], int) and not isinstance(rec["unixReviewTime"], bool) and isinstance(rec["reviewerID"], str) and isinstance(rec["asin"], str):
            rec["asin"] = 5
    elif kind == "huge":
        rec["unixReviewTime"] = draw(st.integers(2**63, 10**40))
    text = json.dumps(rec)
    if kind == "nested":
        text = "[" * 50_000 + "]" * 50_000
    elif kind == "truncate":
        text = text[: draw(st.integers(1, len(text) - 1))]
    elif kind == "not object":
        text = json.dumps(draw(json_values.filter(lambda v: not isinstance(v, dict))))
    lines[n] = text + "\n"
    return "".join(lines).encode()


@settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=corrupted_reviews())
@example(raw=REVIEWS.replace('"unixReviewTime": 1000', '"unixReviewTime": ' + "9" * 5000, 1).encode())
def test_corrupted_review_dump_ends_in_a_data_error_naming_file_and_line(raw: bytes) -> None:
    from gr2model.data.dataset import DataError, load_raw_reviews

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "reviews_Beauty_5.json"
        path.write_bytes(raw)
        with pytest.raises(DataError, match=r"^reviews_Beauty_5\.json line \d+: "):
            load_raw_reviews(path, k=1, min_seq_len=3)
