"""Per-example gains and bootstrap intervals (the evaluate stage's confidence intervals)."""

from __future__ import annotations

import numpy as np
import pytest

from gr2model.task.metrics import bootstrap_ci, ndcg_at_k, per_example_gain, recall_at_k


def test_per_example_gain_means_are_the_metrics() -> None:
    ranks = np.array([0, 1, 2, 5, -1, 0, 3])
    for k in (1, 3, 5):
        assert per_example_gain(ranks, f"recall@{k}").mean() == pytest.approx(recall_at_k(ranks, k))
        assert per_example_gain(ranks, f"ndcg@{k}").mean() == pytest.approx(ndcg_at_k(ranks, k))
    with pytest.raises(ValueError, match="unknown metric"):
        per_example_gain(ranks, "mrr@3")


def test_bootstrap_interval_covers_the_mean_and_shrinks_with_n() -> None:
    rng = np.random.default_rng(1)
    small, large = rng.random(100) < 0.3, rng.random(10_000) < 0.3
    lo_s, hi_s = bootstrap_ci(small.astype(float))
    lo_l, hi_l = bootstrap_ci(large.astype(float))
    assert lo_s <= small.mean() <= hi_s and lo_l <= large.mean() <= hi_l
    assert (hi_l - lo_l) < (hi_s - lo_s) / 5  # width ~ 1/sqrt(n): 10x narrower for 100x the examples
    assert bootstrap_ci(small.astype(float)) == (lo_s, hi_s)  # seeded: the same interval twice


def test_paired_interval_cancels_what_both_share() -> None:
    rng = np.random.default_rng(2)
    base = (rng.random(2000) < 0.3).astype(float)
    better = base.copy()
    flip = np.flatnonzero(base == 0)[:60]  # 60 more hits, nothing else changes: +0.03
    better[flip] = 1.0
    lo, hi = bootstrap_ci(better, baseline=base)
    assert 0.0 < lo <= 0.03 <= hi
    # Unpaired, the same difference is lost in the noise of either mean.
    lo_a, hi_a = bootstrap_ci(better)
    assert hi - lo < (hi_a - lo_a) / 2
    assert bootstrap_ci(base, baseline=base) == (0.0, 0.0)
    with pytest.raises(ValueError, match="equal shapes"):
        bootstrap_ci(base, baseline=base[:10])
