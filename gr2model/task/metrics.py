"""Ranking metrics shared by every stage: full-catalogue retrieval and K-candidate re-ranking.

All functions take the 0-based rank of the target (0 = first place, -1 = the
target is absent from the ranked list) so that one definition of Recall@k and
NDCG@k serves the pre-ranker, the re-rankers and the baselines alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


def recall_at_k(ranks: np.ndarray, k: int) -> float:
    """Share of examples whose target is in the top k.

    Args:
        ranks: (n,) int, 0-based rank of the target, -1 when absent.
    """
    if ranks.size == 0:
        return 0.0
    return float(np.mean((ranks >= 0) & (ranks < k)))


def ndcg_at_k(ranks: np.ndarray, k: int) -> float:
    """NDCG@k with a single relevant item: 1 / log2(rank + 2) when rank < k, else 0.

    Args:
        ranks: (n,) int, 0-based rank of the target, -1 when absent.
    """
    if ranks.size == 0:
        return 0.0
    hit = (ranks >= 0) & (ranks < k)
    gains = np.where(hit, 1.0 / np.log2(np.maximum(ranks, 0) + 2.0), 0.0)
    return float(np.mean(gains))


def ranking_metrics(
    ranks: np.ndarray, recall_ks: Iterable[int], ndcg_ks: Iterable[int]
) -> dict[str, float]:
    """`{"recall@k": ..., "ndcg@k": ..., "n": n}` for the given cut-offs.

    Args:
        ranks: (n,) int, 0-based rank of the target, -1 when absent.
    """
    out: dict[str, float] = {f"recall@{k}": recall_at_k(ranks, k) for k in recall_ks}
    out.update({f"ndcg@{k}": ndcg_at_k(ranks, k) for k in ndcg_ks})
    out["n"] = int(ranks.size)
    return out


def rank_in_lists(lists: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """0-based position of each target in its ranked list, -1 when absent.

    Args:
        lists: (n, K) int item ids, best first.
        targets: (n,) int item ids.
    Returns:
        (n,) int64.
    """
    hits = lists == targets[:, None]
    found = hits.any(axis=1)
    return np.where(found, hits.argmax(axis=1), -1).astype(np.int64)


def target_rank_full(
    scores: np.ndarray, targets: np.ndarray, exclude: Sequence[Sequence[int]]
) -> np.ndarray:
    """0-based rank of each target among all catalogue items (full ranking).

    Item 0 (padding) and the items in `exclude[i]` (the user's history) are never
    ranked, since a recommender must not return them; ties count against the
    target (pessimistic), so a constant scorer gets no credit.

    Args:
        scores: (n, V) float, V = num_items + 1, column j scores item j.
        targets: (n,) int item ids in 1..V-1.
        exclude: n lists of item ids to drop (the target itself is never dropped).
    Returns:
        (n,) int64 ranks in 0..V-2.
    """
    s = np.array(scores, dtype=np.float32, copy=True)
    s[:, 0] = -np.inf
    rows = np.arange(len(targets))
    target_scores = s[rows, targets].copy()
    for i, hist in enumerate(exclude):
        if len(hist):
            s[i, np.asarray(hist, dtype=np.int64)] = -np.inf
    s[rows, targets] = -np.inf
    return (s >= target_scores[:, None]).sum(axis=1).astype(np.int64)


def per_example_gain(ranks: np.ndarray, metric: str) -> np.ndarray:
    """(n,) float: each example's contribution to `metric` ("recall@k" or "ndcg@k"),
    so that its mean is `recall_at_k` / `ndcg_at_k` (what a bootstrap resamples).

    Args:
        ranks: (n,) int, 0-based rank of the target, -1 when absent.
    """
    kind, _, k_text = metric.partition("@")
    k = int(k_text)
    hit = (ranks >= 0) & (ranks < k)
    if kind == "recall":
        return hit.astype(np.float64)
    if kind == "ndcg":
        return np.where(hit, 1.0 / np.log2(np.maximum(ranks, 0) + 2.0), 0.0)
    raise ValueError(f"unknown metric {metric!r}: expected recall@k or ndcg@k")


def bootstrap_ci(
    values: np.ndarray, *, baseline: np.ndarray | None = None, n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(values), or of the paired difference
    mean(values - baseline) when `baseline` is given (the same resampled examples
    for both, so what two re-rankers share cancels out).

    Args:
        values, baseline: (n,) float per-example scores (`per_example_gain`).
    Returns:
        (lo, hi); (nan, nan) for no examples.
    """
    x = np.asarray(values, dtype=np.float64)
    if baseline is not None:
        b = np.asarray(baseline, dtype=np.float64)
        if b.shape != x.shape:
            raise ValueError(f"paired bootstrap needs equal shapes, got {x.shape} and {b.shape}")
        x = x - b
    if x.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    # (n_boot, n) index draws in chunks keep memory bounded for large n.
    means = np.concatenate(
        [x[rng.integers(0, x.size, size=(min(500, n_boot - s), x.size))].mean(axis=1) for s in range(0, n_boot, 500)]
    )
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return (float(lo), float(hi))
