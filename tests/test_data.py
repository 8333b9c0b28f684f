"""Tests of gr2model.data.dataset: loaders, k-core, split, prepared files.

Tests on the full shared data use the `shared_data` fixture (tests/conftest.py),
which skips them when the data set is absent."""

from __future__ import annotations

import gzip
import json
import random
from collections import Counter
from pathlib import Path

import polars as pl
import pytest

from gr2model.data.dataset import (
    DataError,
    Dataset,
    detect_format,
    download_raw,
    kcore_filter,
    leave_one_out,
    load_prepared,
    load_raw_reviews,
    load_sequence_dataset,
    raw_reviews_files,
    save_prepared,
)


# ------------------------------------------------------------------ helpers


def write_sequence_files(
    d: Path,
    lines: list[str],
    attrs: dict[str, list[int]] | None = None,
    sids: dict[str, list[int]] | None = None,
) -> Path:
    """A small sequence-format data folder; by default every item gets an attribute
    and a distinct 4-code sid."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "Beauty.txt").write_text("\n".join(lines) + "\n")
    items = sorted({int(t) for line in lines for t in line.split()[1:] if t.lstrip("-").isdigit()})
    if attrs is None:
        attrs = {str(i): [i % 3 + 1] for i in items}
    if sids is None:
        sids = {str(i): [i % 5, i % 7, 0, i] for i in items}
    (d / "Beauty_item2attributes.json").write_text(json.dumps(attrs))
    (d / "Beauty_item2sid_rqvae.json").write_text(json.dumps(sids))
    return d


GOOD_LINES = ["1 10 11 12 13", "2 11 12 14", "3 10 14 15 11 12"]


def reference_kcore(rows: list[tuple[str, str]], k: int) -> set[int]:
    """Brute force: delete one key with fewer than k rows at a time until none is
    left. Returns the indices of the surviving rows."""
    alive = set(range(len(rows)))
    while True:
        users = Counter(rows[i][0] for i in alive)
        items = Counter(rows[i][1] for i in alive)
        weak_user = next((u for u, c in users.items() if c < k), None)
        weak_item = next((it for it, c in items.items() if c < k), None)
        if weak_user is None and weak_item is None:
            return alive
        if weak_user is not None:
            alive = {i for i in alive if rows[i][0] != weak_user}
        else:
            alive = {i for i in alive if rows[i][1] != weak_item}


def one_pass_is_fixed_point(rows: list[tuple[str, str]], k: int) -> bool:
    users = Counter(u for u, _ in rows)
    items = Counter(it for _, it in rows)
    kept = [(u, it) for u, it in rows if users[u] >= k and items[it] >= k]
    users2 = Counter(u for u, _ in kept)
    items2 = Counter(it for _, it in kept)
    return all(c >= k for c in users2.values()) and all(c >= k for c in items2.values())


def make_reviews(seed: int = 3, k: int = 3) -> list[dict]:
    """Random reviews around a dense core; times drawn from a few values so ties occur.
    Asserts that the k-core of this data needs more than one filtering pass."""
    rng = random.Random(seed)
    reviews = []
    # dense core: 6 users x 6 items, all degrees >= k
    for u in range(6):
        for i in range(6):
            reviews.append({"reviewerID": f"U{u}", "asin": f"B{i:03d}", "unixReviewTime": rng.randint(1, 4)})
    # fringe: users with 1..k+1 reviews over core and rare items
    for u in range(6, 30):
        for i in rng.sample(range(20), rng.randint(1, k + 1)):
            reviews.append({"reviewerID": f"U{u}", "asin": f"B{i:03d}", "unixReviewTime": rng.randint(1, 4)})
    # a chain that only unravels pass by pass: rare item R0 (2 reviews) holds user C0 at 3
    # reviews; once R0 goes, C0 goes, which drops item R1 below k, and so on.
    for j in range(4):
        reviews.append({"reviewerID": f"C{j}", "asin": f"R{j}", "unixReviewTime": 5})
        reviews.append({"reviewerID": f"C{j}", "asin": "B000", "unixReviewTime": 5})
        reviews.append({"reviewerID": f"C{j}", "asin": f"R{j + 1}", "unixReviewTime": 5})
        reviews.append({"reviewerID": f"D{j}", "asin": f"R{j + 1}", "unixReviewTime": 6})
    rng.shuffle(reviews)
    rows = [(r["reviewerID"], r["asin"]) for r in reviews]
    assert not one_pass_is_fixed_point(rows, k)
    assert 0 < len(reference_kcore(rows, k)) < len(rows)
    return reviews


def write_reviews(path: Path, reviews: list[dict], *, gz: bool) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in reviews)
    if gz:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def expected_sequences(reviews: list[dict], k: int) -> tuple[list[str], list[list[str]]]:
    """Reference for load_raw_reviews: user keys in order of first review, each user's
    asins sorted by time with ties in file order."""
    rows = [(r["reviewerID"], r["asin"]) for r in reviews]
    alive = sorted(reference_kcore(rows, k))
    users: list[str] = []
    for i in alive:
        if reviews[i]["reviewerID"] not in users:
            users.append(reviews[i]["reviewerID"])
    seqs = []
    for u in users:
        mine = [i for i in alive if reviews[i]["reviewerID"] == u]
        mine.sort(key=lambda i: (reviews[i]["unixReviewTime"], i))
        seqs.append([reviews[i]["asin"] for i in mine])
    return users, seqs


# --------------------------------------------------------------- shared data


def test_shared_beauty_counts(shared_data: Path) -> None:
    ds = load_sequence_dataset(shared_data)
    assert ds.num_users == 22_363
    assert ds.num_interactions == 198_502
    assert ds.items.height == 12_101
    assert ds.items["item_id"].to_list() == list(range(1, 12_102))
    assert ds.num_items == 12_101
    assert ds.sequences["items"].list.len().min() >= 5
    assert round(ds.avg_seq_len, 2) == 8.88
    assert ds.sequences["user_id"].to_list() == list(range(1, 22_364))
    sid_lens = ds.items["sid"].list.len()
    assert sid_lens.min() == sid_lens.max() == 4
    assert ds.items["sid"].n_unique() == 12_101
    assert ds.items["attributes"].list.len().min() >= 1
    assert ds.sequences.schema == pl.Schema({"user_id": pl.Int64, "items": pl.List(pl.Int64)})


def test_shared_beauty_max_users_and_no_side_files(shared_data: Path) -> None:
    ds = load_sequence_dataset(shared_data, attributes_file=None, sid_file=None, max_users=50)
    assert ds.num_users == 50
    assert ds.items["sid"].null_count() == ds.items.height
    assert ds.items["attributes"].list.len().max() == 0
    first = (shared_data / "Beauty.txt").read_text().splitlines()[0].split()
    assert ds.sequences["items"][0].to_list() == [int(t) for t in first[1:]]


# -------------------------------------------------------- sequence format


def test_sequence_format_small(tmp_path: Path) -> None:
    d = write_sequence_files(tmp_path, ["3 10 14 15 11 12", "1 10 11 12 13", "", "2 11 12 14"])
    ds = load_sequence_dataset(d)
    assert ds.sequences["user_id"].to_list() == [1, 2, 3]
    assert ds.sequences["items"].to_list() == [[10, 11, 12, 13], [11, 12, 14], [10, 14, 15, 11, 12]]
    assert ds.items["item_id"].to_list() == [10, 11, 12, 13, 14, 15]
    assert ds.items["sid"][0].to_list() == [0, 3, 0, 10]
    assert ds.num_items == 15
    assert ds.num_interactions == 12
    assert ds.avg_seq_len == pytest.approx(4.0)
    assert ds.attribute_map()[11] == [11 % 3 + 1]


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"Beauty\.txt: file not found"):
        load_sequence_dataset(tmp_path)


def test_empty_file(tmp_path: Path) -> None:
    (tmp_path / "Beauty.txt").write_text("\n  \n")
    with pytest.raises(DataError, match=r"Beauty\.txt: file is empty"):
        load_sequence_dataset(tmp_path)


def test_non_integer_token(tmp_path: Path) -> None:
    d = write_sequence_files(tmp_path, ["1 10 11 12", "2 10 x9 12"])
    with pytest.raises(DataError, match=r"Beauty\.txt line 2: token 'x9' is not an integer"):
        load_sequence_dataset(d)


def test_zero_id_is_rejected(tmp_path: Path) -> None:
    d = write_sequence_files(tmp_path, ["1 10 11 12", "2 10 0 12"])
    with pytest.raises(DataError, match=r"Beauty\.txt line 2: id 0 must be >= 1"):
        load_sequence_dataset(d)


def test_duplicated_user(tmp_path: Path) -> None:
    d = write_sequence_files(tmp_path, ["1 10 11 12", "2 10 11 12", "3 10 11 12", "2 12 11 10"])
    with pytest.raises(DataError, match=r"Beauty\.txt lines 2 and 4: user 2 appears on both lines"):
        load_sequence_dataset(d)


def test_short_user(tmp_path: Path) -> None:
    d = write_sequence_files(tmp_path, ["1 10 11 12", "2 10 11"])
    with pytest.raises(DataError, match=r"Beauty\.txt line 2: user 2 has 2 items, fewer than min_seq_len=3"):
        load_sequence_dataset(d)
    assert load_sequence_dataset(d, min_seq_len=2).num_users == 2


def test_item_missing_from_attributes(tmp_path: Path) -> None:
    d = write_sequence_files(tmp_path, GOOD_LINES, attrs={str(i): [1] for i in (10, 11, 12, 13, 15)})
    with pytest.raises(DataError, match=r"Beauty_item2attributes\.json: item 14 has no entry \(used in Beauty\.txt line 2\)"):
        load_sequence_dataset(d)


def test_item_missing_from_sids(tmp_path: Path) -> None:
    d = write_sequence_files(tmp_path, GOOD_LINES, sids={str(i): [1, 2, 3, i] for i in (10, 11, 12, 13, 14)})
    with pytest.raises(DataError, match=r"Beauty_item2sid_rqvae\.json: item 15 has no entry \(used in Beauty\.txt line 3\)"):
        load_sequence_dataset(d)


def test_sid_wrong_length(tmp_path: Path) -> None:
    sids = {str(i): [1, 2, 3, i] for i in range(10, 16)}
    sids["12"] = [1, 2, 12]
    d = write_sequence_files(tmp_path, GOOD_LINES, sids=sids)
    with pytest.raises(DataError, match=r"Beauty_item2sid_rqvae\.json item 12: semantic id has length 3, expected 4"):
        load_sequence_dataset(d)
    assert load_sequence_dataset(d, sid_file=None).items["sid"].null_count() == 6


def test_sid_duplicate(tmp_path: Path) -> None:
    sids = {str(i): [1, 2, 3, i] for i in range(10, 16)}
    sids["14"] = [1, 2, 3, 11]
    d = write_sequence_files(tmp_path, GOOD_LINES, sids=sids)
    with pytest.raises(DataError, match=r"items 11 and 14: both have semantic id"):
        load_sequence_dataset(d)


def test_bad_json_side_file(tmp_path: Path) -> None:
    d = write_sequence_files(tmp_path, GOOD_LINES)
    (d / "Beauty_item2attributes.json").write_text('{"10": [1],\n "11": [2\n}')
    with pytest.raises(DataError, match=r"Beauty_item2attributes\.json line 3: invalid JSON"):
        load_sequence_dataset(d)
    (d / "Beauty_item2attributes.json").write_text('{"10": [1], "eleven": [2]}')
    with pytest.raises(DataError, match=r"Beauty_item2attributes\.json: key 'eleven' is not an integer"):
        load_sequence_dataset(d)
    (d / "Beauty_item2attributes.json").write_text('{"10": [1, "a"]}')
    with pytest.raises(DataError, match=r"Beauty_item2attributes\.json item 10: value must be a list of integers"):
        load_sequence_dataset(d)


# ------------------------------------------------------------- k-core, raw


def test_kcore_filter_matches_brute_force() -> None:
    for seed in range(5):
        reviews = make_reviews(seed=seed)
        rows = [(r["reviewerID"], r["asin"]) for r in reviews]
        df = pl.DataFrame({"user_key": [u for u, _ in rows], "item_key": [i for _, i in rows]}).with_row_index("row")
        out = kcore_filter(df, 3)
        assert sorted(out["row"].to_list()) == sorted(reference_kcore(rows, 3))
        assert out["row"].to_list() == sorted(out["row"].to_list())  # order kept
        assert out.columns == ["row", "user_key", "item_key"]
        # fixed point: a second call removes nothing
        assert kcore_filter(out, 3).height == out.height


@pytest.mark.parametrize("gz", [False, True])
def test_load_raw_reviews_matches_reference(tmp_path: Path, gz: bool) -> None:
    reviews = make_reviews()
    path = write_reviews(tmp_path / ("reviews_Toy_5.json" + (".gz" if gz else "")), reviews, gz=gz)
    ds = load_raw_reviews(path, k=3)
    users, seqs = expected_sequences(reviews, 3)
    assert ds.user_keys is not None and ds.item_keys is not None
    assert ds.user_keys["user_key"].to_list() == users
    assert ds.user_keys["user_id"].to_list() == list(range(1, len(users) + 1))
    key_of = dict(zip(ds.item_keys["item_id"].to_list(), ds.item_keys["item_key"].to_list()))
    got = [[key_of[i] for i in s] for s in ds.sequences["items"].to_list()]
    assert got == seqs
    # items numbered by first appearance along the sequences
    flat = [i for s in ds.sequences["items"].to_list() for i in s]
    firsts = list(dict.fromkeys(flat))
    assert firsts == list(range(1, len(firsts) + 1))
    assert ds.items["item_id"].to_list() == firsts
    assert ds.items["sid"].null_count() == ds.items.height
    assert ds.sequences["items"].list.len().min() >= 3


def test_raw_gzip_detected_by_magic_bytes(tmp_path: Path) -> None:
    reviews = make_reviews()
    gz = write_reviews(tmp_path / "reviews_Toy_5.json", reviews, gz=True)  # gzip without .gz
    plain = write_reviews(tmp_path / "plain.json", reviews, gz=False)
    assert load_raw_reviews(gz, k=3).sequences.equals(load_raw_reviews(plain, k=3).sequences)


def test_raw_time_ties_keep_file_order_and_max_users(tmp_path: Path) -> None:
    reviews = [
        {"reviewerID": "B", "asin": "x", "unixReviewTime": 5},
        {"reviewerID": "A", "asin": "y", "unixReviewTime": 5},
        {"reviewerID": "B", "asin": "y", "unixReviewTime": 3},
        {"reviewerID": "B", "asin": "z", "unixReviewTime": 5},
        {"reviewerID": "A", "asin": "z", "unixReviewTime": 1},
        {"reviewerID": "A", "asin": "w", "unixReviewTime": 9},
    ]
    path = write_reviews(tmp_path / "r.json", reviews, gz=False)
    ds = load_raw_reviews(path, k=1)
    assert ds.user_keys is not None and ds.item_keys is not None
    assert ds.user_keys["user_key"].to_list() == ["B", "A"]  # B reviews first in the file
    assert ds.item_keys["item_key"].to_list() == ["y", "x", "z", "w"]
    assert ds.sequences["items"].to_list() == [[1, 2, 3], [3, 1, 4]]  # B: y(3) x(5) z(5); A: z y w
    small = load_raw_reviews(path, k=1, max_users=1)
    assert small.sequences["items"].to_list() == [[1, 2, 3]]
    assert small.item_keys is not None and small.item_keys["item_key"].to_list() == ["y", "x", "z"]


def test_raw_meta_attributes(tmp_path: Path) -> None:
    reviews = [{"reviewerID": u, "asin": a, "unixReviewTime": t}
               for t, (u, a) in enumerate([("u", "A1"), ("u", "A2"), ("u", "A3")])]
    path = write_reviews(tmp_path / "reviews_Toy_5.json", reviews, gz=False)
    meta = tmp_path / "meta_Toy.json"
    meta.write_text(
        "{'asin': 'A1', 'categories': [['Beauty', 'Skin'], ['Beauty']], 'brand': 'Acme'}\n"
        '{"asin": "A2", "categories": [["Beauty", "Hair"]]}\n'
        "{'asin': 'ZZ', 'categories': [['Not', 'used']], 'brand': 'Other'}\n"
    )
    ds = load_raw_reviews(path, meta_path=meta, k=1)
    # vocabulary, sorted: Beauty=1, Hair=2, Skin=3, brand:Acme=4
    assert ds.items["attributes"].to_list() == [[1, 3, 4], [1, 2], []]
    assert raw_reviews_files(tmp_path) == (path, meta)


def test_raw_bad_json(tmp_path: Path) -> None:
    p = tmp_path / "r.json"
    p.write_text('{"reviewerID": "a", "asin": "x", "unixReviewTime": 1}\n{"reviewerID": "a", "asin": \n')
    with pytest.raises(DataError, match=r"r\.json line 2: invalid JSON"):
        load_raw_reviews(p, k=1)


def test_raw_missing_field(tmp_path: Path) -> None:
    p = write_reviews(
        tmp_path / "r.json.gz",
        [{"reviewerID": "a", "asin": "x", "unixReviewTime": 1}, {"reviewerID": "a", "unixReviewTime": 2}],
        gz=True,
    )
    with pytest.raises(DataError, match=r"r\.json\.gz line 2: field 'asin' is missing"):
        load_raw_reviews(p, k=1)
    p2 = write_reviews(tmp_path / "r2.json", [{"reviewerID": "a", "asin": "x", "unixReviewTime": "1"}], gz=False)
    with pytest.raises(DataError, match=r"r2\.json line 1: field 'unixReviewTime' should be int"):
        load_raw_reviews(p2, k=1)


def test_raw_bad_meta_line(tmp_path: Path) -> None:
    p = write_reviews(tmp_path / "r.json", [{"reviewerID": "a", "asin": "x", "unixReviewTime": 1}] * 3, gz=False)
    meta = tmp_path / "meta.json"
    meta.write_text("{'asin': 'x', 'categories': [['A']]}\n{'asin': 'x', 'categories': [['A']\n")
    with pytest.raises(DataError, match=r"meta\.json line 2: neither JSON nor a Python dict literal"):
        load_raw_reviews(p, meta_path=meta, k=1)
    meta.write_text("{'asin': 'x', 'categories': ['A']}\n")
    with pytest.raises(DataError, match=r"meta\.json line 1: field 'categories'"):
        load_raw_reviews(p, meta_path=meta, k=1)


# ------------------------------------------------------------------- split


def test_leave_one_out() -> None:
    seqs = pl.DataFrame({"user_id": [1, 2], "items": [[5, 6, 7, 8], [9, 3, 4]]})
    split = leave_one_out(seqs)
    assert split.to_dicts() == [
        {"user_id": 1, "train": [5, 6], "valid": 7, "test": 8},
        {"user_id": 2, "train": [9], "valid": 3, "test": 4},
    ]
    assert split.schema == pl.Schema(
        {"user_id": pl.Int64, "train": pl.List(pl.Int64), "valid": pl.Int64, "test": pl.Int64}
    )
    with pytest.raises(DataError, match="user 3: 2 items"):
        leave_one_out(pl.DataFrame({"user_id": [3], "items": [[1, 2]]}))


# --------------------------------------------------------- prepared files


def _small_dataset(tmp_path: Path) -> Dataset:
    reviews = make_reviews()
    return load_raw_reviews(write_reviews(tmp_path / "r.json", reviews, gz=False), k=3)


def test_save_load_prepared_roundtrip(tmp_path: Path) -> None:
    ds = _small_dataset(tmp_path)
    split = leave_one_out(ds.sequences)
    out = tmp_path / "prepared"
    save_prepared(ds, split, out)
    ds2, split2 = load_prepared(out)
    assert ds2.sequences.equals(ds.sequences)
    assert ds2.items.equals(ds.items)
    assert split2.equals(split)
    assert ds2.user_keys is not None and ds.user_keys is not None and ds2.user_keys.equals(ds.user_keys)
    assert ds2.num_items == ds.num_items
    # overwrite with a dataset without keys: old key files must not linger
    save_prepared(Dataset(ds.sequences, ds.items), split, out)
    assert load_prepared(out)[0].user_keys is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared", "r.json"]


def test_save_prepared_failure_leaves_no_partial_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = _small_dataset(tmp_path)
    split = leave_one_out(ds.sequences)
    out = tmp_path / "prepared"
    real = pl.DataFrame.write_parquet
    calls = {"n": 0}

    def flaky(self: pl.DataFrame, file: Path, *args: object, **kwargs: object) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        real(self, file, *args, **kwargs)

    monkeypatch.setattr(pl.DataFrame, "write_parquet", flaky)
    with pytest.raises(OSError, match="disk full"):
        save_prepared(ds, split, out)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]

    # an earlier complete output survives a failed rewrite untouched
    monkeypatch.setattr(pl.DataFrame, "write_parquet", real)
    save_prepared(ds, split, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls["n"] = 0
    monkeypatch.setattr(pl.DataFrame, "write_parquet", flaky)
    with pytest.raises(OSError):
        save_prepared(Dataset(ds.sequences, ds.items), split, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared", "r.json"]


def test_load_prepared_missing(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"sequences\.parquet: missing from"):
        load_prepared(tmp_path)


# ------------------------------------------------------ finding the data


def test_detect_format(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"looked for Beauty\.txt .*reviews_\*\.json or reviews_\*\.json\.gz"):
        detect_format(tmp_path, "Beauty.txt")
    (tmp_path / "reviews_Beauty_5.json.gz").write_bytes(gzip.compress(b""))
    assert detect_format(tmp_path, "Beauty.txt") == "raw"
    (tmp_path / "Beauty.txt").write_text("1 2 3 4\n")
    assert detect_format(tmp_path, "Beauty.txt") == "sequence"


def test_raw_reviews_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no reviews_"):
        raw_reviews_files(tmp_path)
    r = tmp_path / "reviews_Beauty_5.json.gz"
    r.write_bytes(b"")
    assert raw_reviews_files(tmp_path) == (r, None)
    m = tmp_path / "meta_Beauty.json.gz"
    m.write_bytes(b"")
    assert raw_reviews_files(tmp_path) == (r, m)
    (tmp_path / "reviews_Beauty.json").write_text("")
    with pytest.raises(DataError, match="several review files"):
        raw_reviews_files(tmp_path)


def test_download_raw_file_url(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "reviews_Toy_5.json.gz").write_bytes(gzip.compress(b'{"a": 1}\n'))
    (src / "meta_Toy.json.gz").write_bytes(gzip.compress(b"{'asin': 'x'}\n"))
    dest = tmp_path / "dest"
    got = download_raw("Toy", dest, base_url=src.as_uri())
    assert got == dest / "reviews_Toy_5.json.gz"
    assert sorted(p.name for p in dest.iterdir()) == ["meta_Toy.json.gz", "reviews_Toy_5.json.gz"]
    assert got.read_bytes() == (src / "reviews_Toy_5.json.gz").read_bytes()
    assert "downloading reviews_Toy_5.json.gz" in capsys.readouterr().err
    with pytest.raises(DataError, match=r"reviews_Nope_5\.json\.gz: download from .* failed"):
        download_raw("Nope", dest, base_url=src.as_uri())
    assert sorted(p.name for p in dest.iterdir()) == ["meta_Toy.json.gz", "reviews_Toy_5.json.gz"]
    with pytest.raises(DataError, match="category"):
        download_raw("../etc", dest, base_url=src.as_uri())
