"""`gr2 serve-check`'s judgement: which evaluate row a version's numbers came from, when the comparison is
refused, and the list-for-list comparison (no server, no MLflow: the HTTP path is in tests/test_serving.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import polars as pl
import pytest
import yaml

from flows.decoder_setting import DecoderSetting
from flows.serve_check import RANKINGS, ServeCheck, ServeCheckError, check_rankings_file, differences, evaluated_rankings, version_row
from gr2model.task.rerank_format import ParsedResponse
from tasks.evaluate import RANKINGS as EVALUATE_RANKINGS
from tasks.evaluate import write_rankings



def test_the_version_names_its_row_only_when_its_numbers_are_sound() -> None:
    label = DecoderSetting(decoder="ar").label()
    good = {**DecoderSetting(decoder="ar").tags(), "checkpoint_md5": "abc", "eval.model": "gr2", "eval.checkpoint_md5": "abc", "eval.setting": label}
    assert version_row(good) == ("gr2", label)
    with pytest.raises(ServeCheckError, match="no eval"):
        version_row({k: v for k, v in good.items() if k != "eval.model"})
    with pytest.raises(ServeCheckError, match="unverified"):
        version_row({**good, "eval.checkpoint_md5": "unverified"})
    with pytest.raises(ServeCheckError, match="measured on checkpoint abd"):
        version_row({**good, "eval.checkpoint_md5": "abd"})
    other = DecoderSetting(decoder="ar", grammar=True).label()
    with pytest.raises(ServeCheckError, match="it serves"):
        version_row({**good, "eval.setting": other})


def _parsed(ranking: list[int], valid: bool) -> ParsedResponse:
    return ParsedResponse(valid_format=valid, valid_permutation=valid, ranking=ranking, explanation="", error="" if valid else "not a permutation", copies_incoming=False)


def test_evaluate_writes_every_rows_rankings_in_example_order(tmp_path: Path) -> None:
    lists = {"test": pl.DataFrame({"user_id": [7, 3, 9]})}
    answers = {"gr2": {"test": [_parsed([2, 1], True), _parsed([1, 2], False), _parsed([5, 6], True)]}, "dgr2": {"test": [_parsed([1, 2], True)]}}
    write_rankings(answers, lists, tmp_path / EVALUATE_RANKINGS)
    assert EVALUATE_RANKINGS == RANKINGS
    table = pl.read_parquet(tmp_path / RANKINGS)
    gr2 = table.filter(pl.col("row") == "gr2")
    assert gr2["example"].to_list() == [0, 1, 2] and gr2["user_id"].to_list() == [7, 3, 9]
    assert gr2["ranking"].to_list() == [[2, 1], [1, 2], [5, 6]] and gr2["valid"].to_list() == [True, False, True]
    assert evaluated_rankings(table, "gr2", "test", 2, [7, 3]) == [[2, 1], [1, 2]]
    assert evaluated_rankings(table, "dgr2", "test", 1, [7]) == [[1, 2]]
    with pytest.raises(ServeCheckError, match="has 1 test rankings of row 'dgr2', 2 asked for"):
        evaluated_rankings(table, "dgr2", "test", 2, [7, 3])
    with pytest.raises(ServeCheckError, match="users differ"):
        evaluated_rankings(table, "gr2", "test", 2, [3, 7])
    assert not list(tmp_path.glob("reports/.*"))  # nothing half-written left beside it


def test_a_rankings_file_that_dvc_lock_did_not_record_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ServeCheckError, match="no such file"):
        check_rankings_file(tmp_path)
    path = tmp_path / RANKINGS
    path.parent.mkdir(parents=True)
    pl.DataFrame({"row": ["gr2"]}).write_parquet(path)
    md5 = hashlib.md5(path.read_bytes()).hexdigest()
    lock = {"stages": {"evaluate": {"outs": [{"path": RANKINGS.as_posix(), "md5": md5}]}}}
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock))
    assert check_rankings_file(tmp_path) == path
    pl.DataFrame({"row": ["dgr2"]}).write_parquet(path)  # rewritten after the locked run
    with pytest.raises(ServeCheckError, match="not the file dvc.lock's evaluate wrote"):
        check_rankings_file(tmp_path)


def test_one_differing_or_missing_list_fails_the_check() -> None:
    want = [[1, 2, 3], [3, 2, 1], [2, 1, 3]]
    assert differences(want, [[1, 2, 3], [3, 2, 1], [2, 1, 3]]) == []
    assert differences(want, [[1, 2, 3], [3, 1, 2], [2, 1, 3]]) == [1]
    assert differences(want, [[1, 2, 3]]) == [1, 2]
    report = ServeCheck("gr2@champion", "3", "gr2", "test", "ar", examples=3, equal=2, mismatches=[{"example": 1, "user_id": 5, "evaluated": [3, 2, 1], "served": [3, 1, 2]}])
    assert not report.passed and "2 of 3 rankings equal - FAILED" in report.text() and "example 1 (user 5)" in report.text()
    assert ServeCheck("gr2@champion", "3", "gr2", "test", "ar", examples=3, equal=3).passed
