"""Examples, candidate lists, cross-fitting and re-ranking metrics on hand-made data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest

from gr2model.retrieval.baselines import PopularityScorer, TransitionScorer
from gr2model.data.candidates import (
    candidate_lists,
    crossfit_candidate_lists,
    eval_examples,
    rerank_metrics,
    training_positions,
    user_folds,
    write_parquet_atomic,
)


def make_split(trains: dict[int, list[int]], valid: dict[int, int], test: dict[int, int]) -> pl.DataFrame:
    users = sorted(trains)
    return pl.DataFrame(
        {
            "user_id": users,
            "train": [trains[u] for u in users],
            "valid": [valid[u] for u in users],
            "test": [test[u] for u in users],
        },
        schema={"user_id": pl.Int64, "train": pl.List(pl.Int64), "valid": pl.Int64, "test": pl.Int64},
    )


@pytest.fixture
def hand_split() -> pl.DataFrame:
    return make_split({1: [5, 6, 7, 8], 2: [9], 3: [2, 3]}, {1: 10, 2: 11, 3: 4}, {1: 12, 2: 13, 3: 1})


class FixedScorer:
    """Same score row for every history (a tiny fake Scorer)."""

    def __init__(self, row):
        self.row = np.asarray(row, dtype=np.float32)
        self.num_items = len(self.row) - 1

    def score(self, histories):
        return np.broadcast_to(self.row, (len(histories), len(self.row))).copy()


def test_training_positions_hand_example(hand_split):
    ex = training_positions(hand_split)
    assert ex.columns == ["user_id", "position", "history", "target"]
    assert ex.schema["history"] == pl.List(pl.Int64) and ex.schema["target"] == pl.Int64
    assert ex.rows() == [
        (1, 1, [5], 6),
        (1, 2, [5, 6], 7),
        (1, 3, [5, 6, 7], 8),
        (3, 1, [2], 3),
    ]
    last2 = training_positions(hand_split, positions_per_user=2)
    assert last2.select("user_id", "position").rows() == [(1, 2), (1, 3), (3, 1)]
    assert training_positions(hand_split, min_history=2).select("user_id", "position").rows() == [(1, 2), (1, 3)]
    # min_history=0 admits an empty history at position 0.
    assert training_positions(hand_split, min_history=0).row(0) == (1, 0, [], 5)


def test_history_is_strictly_before_target(hand_split):
    full = {u: t + [v, s] for u, t, v, s in hand_split.iter_rows()}
    frames = [training_positions(hand_split, min_history=0), eval_examples(hand_split, "valid"), eval_examples(hand_split, "test")]
    for ex in frames:
        for user, pos, hist, target in ex.iter_rows():
            assert hist == full[user][:pos]
            assert target == full[user][pos]


def test_eval_examples_hand_example(hand_split):
    v = eval_examples(hand_split, "valid")
    assert v.columns == ["user_id", "position", "history", "target"]
    assert v.rows() == [(1, 4, [5, 6, 7, 8], 10), (2, 1, [9], 11), (3, 2, [2, 3], 4)]
    t = eval_examples(hand_split, "test")
    assert t.rows() == [(1, 5, [5, 6, 7, 8, 10], 12), (2, 2, [9, 11], 13), (3, 3, [2, 3, 4], 1)]
    with pytest.raises(ValueError):
        eval_examples(hand_split, "train")  # type: ignore[arg-type]


def test_user_folds_balanced_and_deterministic():
    ids = np.arange(100, 203)  # 103 users
    f = user_folds(ids, 5, seed=3)
    assert f.shape == (103,) and f.min() == 0 and f.max() == 4
    sizes = np.bincount(f)
    assert sizes.max() - sizes.min() <= 1
    np.testing.assert_array_equal(f, user_folds(ids, 5, seed=3))
    assert not np.array_equal(f, user_folds(ids, 5, seed=4))
    # Order and repetition do not change a user's fold.
    shuffled = np.random.default_rng(0).permutation(np.repeat(ids, 3))
    g = user_folds(shuffled, 5, seed=3)
    lookup = dict(zip(ids.tolist(), f.tolist()))
    assert [lookup[u] for u in shuffled.tolist()] == g.tolist()


def test_candidates_exclude_history_and_padding_and_rank_target():
    # Scorer prefers low ids, and gives padding the highest score of all.
    row = np.array([100, 9, 8, 7, 6, 5, 4, 3, 2, 1], dtype=np.float32)
    ex = pl.DataFrame(
        {"user_id": [1, 2, 3], "position": [2, 1, 1], "history": [[1, 2], [3], [4]], "target": [4, 2, 9]},
        schema={"user_id": pl.Int64, "position": pl.Int64, "history": pl.List(pl.Int64), "target": pl.Int64},
    )
    out = candidate_lists(FixedScorer(row), ex, k=3)
    assert out.schema["candidates"] == pl.List(pl.Int64)
    assert out.schema["cand_scores"] == pl.List(pl.Float32)
    assert out.schema["target_rank"] == pl.Int64
    assert out["candidates"].to_list() == [[3, 4, 5], [1, 2, 4], [1, 2, 3]]
    assert out["cand_scores"].to_list()[0] == [7.0, 6.0, 5.0]
    assert out["target_rank"].to_list() == [1, 1, -1]


def test_candidates_never_contain_history_on_random_data():
    rng = np.random.default_rng(0)
    num_items = 40
    seqs = [rng.choice(np.arange(1, num_items + 1), size=int(rng.integers(2, 12)), replace=False).tolist() for _ in range(60)]
    split = make_split({u: s[:-2] for u, s in enumerate(seqs)}, {u: s[-2] for u, s in enumerate(seqs)}, {u: s[-1] for u, s in enumerate(seqs)})
    ex = training_positions(split, min_history=0)
    out = candidate_lists(TransitionScorer(split["train"].to_list(), num_items), ex, k=10, chunk_size=7)
    for hist, cands, target, rank in out.select("history", "candidates", "target", "target_rank").iter_rows():
        assert len(cands) == 10 and len(set(cands)) == 10
        assert 0 not in cands and not set(hist) & set(cands)
        assert rank == (cands.index(target) if target in cands else -1)


def test_crossfit_never_fits_on_the_fold_and_covers_every_example():
    rng = np.random.default_rng(1)
    num_items = 50
    n_users = 23
    # Give each user a distinctive first item pair so a sequence identifies its user.
    trains = {u: [u + 1, u + 2] + rng.integers(1, num_items + 1, size=4).tolist() for u in range(n_users)}
    split = make_split(trains, {u: 1 for u in trains}, {u: 2 for u in trains})
    ex = training_positions(split)
    folds = dict(zip(split["user_id"].to_list(), user_folds(split["user_id"].to_numpy(), 4, seed=7).tolist()))
    calls = []

    def fit(seqs, f):
        held_out = [trains[u] for u in trains if folds[u] == f]
        others = [trains[u] for u in trains if folds[u] != f]
        for s in seqs:
            assert s not in held_out, f"fold {f} was fitted on one of its own users"
        assert len(seqs) == len(others)
        calls.append(f)
        return PopularityScorer(seqs, num_items)

    out = crossfit_candidate_lists(ex, split, fit, n_folds=4, k=5, seed=7)
    assert calls == [0, 1, 2, 3]
    assert out.height == ex.height
    # Same rows in the same order, one list each, with the user's fold.
    assert out.select(ex.columns).equals(ex)
    assert out["candidates"].list.len().to_list() == [5] * ex.height
    assert out["fold"].to_list() == [folds[u] for u in out["user_id"].to_list()]
    assert out.columns[-1] == "fold"


def test_crossfit_rejects_unknown_users(hand_split):
    ex = training_positions(hand_split).with_columns(user_id=pl.lit(99, dtype=pl.Int64))
    with pytest.raises(ValueError, match="not in the split"):
        crossfit_candidate_lists(ex, hand_split, lambda s, f: PopularityScorer(s, 13), n_folds=2, k=3)


def test_rerank_metrics_hand_example():
    lists = pl.DataFrame({"target_rank": [0, 2, -1, 4, -1]}, schema={"target_rank": pl.Int64})
    m = rerank_metrics(lists)
    assert m["n"] == 3 and m["n_examples"] == 5
    assert m["coverage"] == pytest.approx(0.6)
    assert m["recall@1"] == pytest.approx(1 / 3)
    assert m["recall@3"] == pytest.approx(2 / 3)
    assert m["recall@5"] == pytest.approx(1.0)
    assert m["ndcg@3"] == pytest.approx((1 + 1 / np.log2(4)) / 3)
    assert m["ndcg@5"] == pytest.approx((1 + 1 / np.log2(4) + 1 / np.log2(6)) / 3)


def test_write_parquet_atomic_roundtrip_and_failure(tmp_path: Path, monkeypatch):
    df = pl.DataFrame({"a": [1, 2, 3]})
    target = tmp_path / "sub" / "lists.parquet"
    write_parquet_atomic(df, target)
    assert pl.read_parquet(target).equals(df)
    assert sorted(p.name for p in target.parent.iterdir()) == ["lists.parquet"]

    def broken_write(self, file, *args, **kwargs):
        Path(file).write_bytes(b"half a parquet file")
        raise OSError("disk full")

    monkeypatch.setattr(pl.DataFrame, "write_parquet", broken_write)
    fresh = tmp_path / "fresh.parquet"
    with pytest.raises(OSError, match="disk full"):
        write_parquet_atomic(df, fresh)
    assert not fresh.exists()
    # The earlier file is untouched and no temporary file is left behind.
    with pytest.raises(OSError):
        write_parquet_atomic(pl.DataFrame({"a": [9]}), target)
    monkeypatch.undo()
    assert pl.read_parquet(target).equals(df)
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["lists.parquet"]


def test_candidate_lists_refuse_short_catalogue():
    ex = pl.DataFrame({"history": [[1, 2, 3]], "target": [4]}, schema={"history": pl.List(pl.Int64), "target": pl.Int64})
    with pytest.raises(ValueError, match="fewer than k"):
        candidate_lists(FixedScorer(np.arange(6)), ex, k=3)  # 5 items, 3 in the history
