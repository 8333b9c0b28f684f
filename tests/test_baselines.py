"""Popularity, transition and ensemble scorers on tiny hand-made sequences."""

from __future__ import annotations

import numpy as np
import pytest

from gr2model.retrieval.baselines import EnsembleScorer, PopularityScorer, TransitionScorer, tune_weight
from gr2model.retrieval.scoring import evaluate_full_ranking, top_k


class FixedScorer:
    """Returns a fixed score row for every history (a tiny fake Scorer)."""

    def __init__(self, row: np.ndarray):
        self.row = np.asarray(row, dtype=np.float32)
        self.num_items = len(self.row) - 1

    def score(self, histories):
        return np.broadcast_to(self.row, (len(histories), len(self.row))).copy()


class LookupScorer:
    """Scores are a per-history row chosen by the history's last item (tiny fake Scorer)."""

    def __init__(self, rows: dict[int, np.ndarray], num_items: int):
        self.rows = rows
        self.num_items = num_items

    def score(self, histories):
        return np.stack([self.rows[h[-1]] for h in histories]).astype(np.float32)


def test_popularity_ranks_most_frequent_first():
    seqs = [[3, 1, 3], [3, 2], [2, 5, 3]]  # counts: 3 -> 4, 2 -> 2, 1 -> 1, 5 -> 1, 4 -> 0
    pop = PopularityScorer(seqs, num_items=5)
    s = pop.score([[], [1]])
    assert s.shape == (2, 6) and s.dtype == np.float32
    assert np.isfinite(s).all()
    ids, _ = top_k(pop, [[]], 5)
    assert ids[0, :2].tolist() == [3, 2]
    assert ids[0, -1] == 4  # never seen: last
    assert pop.counts[3] == 4


def test_transition_learns_planted_pattern():
    rng = np.random.default_rng(0)
    num_items = 30
    # Random sequences in which 7 is always directly followed by 11.
    seqs = []
    for _ in range(200):
        seq = rng.integers(1, num_items + 1, size=8).tolist()
        seq = [i for i in seq if i not in (7, 11)]
        pos = int(rng.integers(0, len(seq) + 1))
        seqs.append(seq[:pos] + [7, 11] + seq[pos:])
    tr = TransitionScorer(seqs, num_items, last_n=1)
    s = tr.score([[3, 7], [7, 3]])
    assert s.shape == (2, num_items + 1) and s.dtype == np.float32 and np.isfinite(s).all()
    assert s[0].argmax() == 11
    # Scores are log-probabilities of a proper distribution over the items.
    assert np.exp(s[0, 1:]).sum() == pytest.approx(1.0, abs=1e-4)
    ranks = evaluate_full_ranking(tr, [[1, 7]] * 4, np.array([11] * 4), ks=(1,))
    assert ranks["recall@1"] == 1.0
    # The most recent item dominates: after [7, 3], 11 is no longer the favourite.
    assert s[1].argmax() != 11


def test_transition_window_and_empty_rows():
    seqs = [[1, 2, 3], [1, 2, 3], [4, 3]]
    direct = TransitionScorer(seqs, 5, window=1)
    wide = TransitionScorer(seqs, 5, window=2)
    assert direct.counts[1, 3] == 0 and wide.counts[1, 3] == 2
    assert wide.counts[1, 2] == 2 and wide.counts[4, 3] == 1
    # window_decay discounts the skip-transitions: distance 2 counts 0.5.
    discounted = TransitionScorer(seqs, 5, window=2, window_decay=0.5)
    assert discounted.counts[1, 3] == pytest.approx(1.0) and discounted.counts[1, 2] == 2
    # Item 5 has no successors and an empty history has no items: both fall back
    # to the popularity prior, which puts the most frequent item (3) first.
    for h in ([5], []):
        s = direct.score([h])[0]
        assert s[1:].argmax() + 1 == 3
        assert np.isfinite(s).all()


def test_transition_ties_broken_by_popularity():
    # 1 is followed by 2 and 4 once each; 4 is more popular overall.
    seqs = [[1, 2], [1, 4], [4], [4], [3]]
    s = TransitionScorer(seqs, 4, last_n=1, smoothing=0.1).score([[1]])[0]
    assert s[4] > s[2] > s[3]


def test_ensemble_weight_zero_equals_base():
    rng = np.random.default_rng(1)
    base = FixedScorer(rng.normal(size=9))
    row = rng.normal(size=9)
    row[0] = -np.inf  # a scorer may put -inf on padding; weight 0 must not turn it into NaN
    other = FixedScorer(row)
    h = [[1], [2, 3]]
    np.testing.assert_array_equal(EnsembleScorer([base, other], [1.0, 0.0]).score(h), base.score(h))
    mixed = EnsembleScorer([base, other], [1.0, 0.5]).score(h)
    np.testing.assert_allclose(mixed[:, 1:], base.score(h)[:, 1:] + 0.5 * other.score(h)[:, 1:], rtol=1e-6)


def test_tune_weight_picks_clearly_best_weight():
    # 6 items. Base always prefers 1 > 2 > 3 ...; other prefers item 6 by 1.0.
    # Targets are item 6, so base + w*other ranks 6 first iff w * 1.0 beats base's lead of 5.
    num_items = 6
    base = FixedScorer(np.array([0, 5, 4, 3, 2, 1, 0], dtype=np.float32))
    other = FixedScorer(np.array([0, 0, 0, 0, 0, 0, 1.0], dtype=np.float32))
    counts = {"base": 0, "other": 0}

    class Counting:
        def __init__(self, inner, name):
            self.inner, self.name, self.num_items = inner, name, num_items

        def score(self, histories):
            counts[self.name] += 1
            return self.inner.score(histories)

    hist = [[]] * 10
    targets = np.full(10, 6)
    grid = [0.0, 1.0, 10.0]
    best, table = tune_weight(Counting(base, "base"), Counting(other, "other"), hist, targets, grid, chunk_size=4)
    assert best == 10.0
    assert table[10.0]["ndcg@10"] == pytest.approx(1.0)
    assert table[0.0]["recall@5"] == 0.0
    assert set(table) == set(grid)
    # Each chunk (3 of them) is scored once per scorer, not once per weight.
    assert counts == {"base": 3, "other": 3}


def test_tune_weight_prefers_zero_when_other_hurts():
    base = LookupScorer({1: np.array([0, 0, 3, 1, 2], dtype=np.float32)}, 4)
    other = FixedScorer(np.array([0, 0, 0, 5, 0], dtype=np.float32))  # pushes 3, the wrong item
    best, _ = tune_weight(base, other, [[1]] * 5, np.full(5, 2), [0.0, 0.5, 2.0], metric="recall@1")
    assert best == 0.0
