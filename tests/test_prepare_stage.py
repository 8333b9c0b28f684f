"""Stage `prepare` end to end on small files: raw Amazon dump -> k-core -> built semantic ids -> tables."""

from __future__ import annotations

import gzip
import json
import logging
import random
from pathlib import Path

import polars as pl
import pytest

from gr2model.data.dataset import load_prepared
from tasks.tracking import StageTracker
from tasks.prepare import METRICS, OUT_DIR, PrepareConfig, SidBuilderConfig, main, run

LOG = logging.getLogger("test")
NO_TRACKING = StageTracker(None)


def write_raw_category(folder: Path, category: str = "Toys", users: int = 60, items: int = 40, seed: int = 0) -> None:
    """A gzip reviews file and a Python-literal meta file, like the 2014 McAuley release."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    lines = []
    for u in range(users):
        for i in rng.sample(range(items), rng.randint(3, 9)):
            lines.append(json.dumps({"reviewerID": f"A{u:04d}", "asin": f"B{i:05d}", "unixReviewTime": rng.randint(0, 10**6)}))
    (folder / f"reviews_{category}_5.json.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    meta = [str({"asin": f"B{i:05d}", "categories": [[category, f"sub{i % 4}"]], "brand": f"brand{i % 3}"}) for i in range(items)]
    (folder / f"meta_{category}.json.gz").write_bytes(gzip.compress(("\n".join(meta) + "\n").encode()))


def test_raw_category_runs_through_with_built_ids(tmp_path: Path) -> None:
    write_raw_category(tmp_path / "raw")
    cfg = PrepareConfig(data_dir="raw", kcore=3, sid_builder=SidBuilderConfig(dim=8, codebook_size=4))
    metrics = run(cfg, tmp_path, LOG, NO_TRACKING)
    assert metrics["format"] == "raw"
    assert metrics["sid_source"] == "built"
    assert metrics["sid_unique_share"] == 1.0
    assert 0.0 < metrics["sid_prefix3_unique_share"] <= 1.0
    ds, split = load_prepared(tmp_path / OUT_DIR)
    assert ds.num_users == metrics["users"] == split.height
    sids = ds.items["sid"].to_list()
    assert all(len(s) == 4 for s in sids) and len({tuple(s) for s in sids}) == len(sids)
    assert ds.items["attributes"].list.len().min() >= 1  # categories and brand from the meta file
    # leave-one-out: train + valid + test is each user's whole sequence
    joined = split.join(ds.sequences, on="user_id")
    for train, valid, test, items in joined.select("train", "valid", "test", "items").iter_rows():
        assert train + [valid, test] == items


def test_bad_input_exits_2_naming_the_line_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    data = tmp_path / "seq"
    data.mkdir()
    (data / "Beauty.txt").write_text("1 1 2 3 4\n2 5 x7 6 7\n")
    (tmp_path / "params.yaml").write_text(
        f"prepare:\n  data_dir: {data}\n  attributes_file: null\n  sid_file: null\n"
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info, caplog.at_level(logging.ERROR):
        main()
    assert exit_info.value.code == 2
    assert "Beauty.txt" in caplog.text and "line 2" in caplog.text
    assert not (tmp_path / OUT_DIR).exists() and not (tmp_path / METRICS).exists()


def test_missing_data_dir_says_how_to_get_data(tmp_path: Path) -> None:
    from gr2model.data.dataset import DataError

    with pytest.raises(DataError, match="gr2 data download"):
        run(PrepareConfig(data_dir="nowhere"), tmp_path, LOG, NO_TRACKING)


def test_sequence_format_subset(shared_data: Path, tmp_path: Path) -> None:
    metrics = run(PrepareConfig(data_dir=str(shared_data), max_users=500), tmp_path, LOG, NO_TRACKING)
    assert metrics["users"] == 500
    ds, split = load_prepared(tmp_path / OUT_DIR)
    assert split["train"].list.len().min() >= 3
    assert pl.Series(ds.items["sid"].to_list()).list.len().unique().to_list() == [4]
