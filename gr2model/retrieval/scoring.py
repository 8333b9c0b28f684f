"""The scorer protocol every pre-ranker implements, and chunked full-catalogue evaluation.

A scorer maps user histories to one score per catalogue item. Scoring all
22k Beauty users at once would need a (22k, 12k) float matrix (about 1 GB), so
everything here works in chunks of rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import numpy as np
from tqdm.auto import tqdm

from gr2model.task.metrics import ranking_metrics, target_rank_full


class Scorer(Protocol):
    """Scores every catalogue item for each history; higher is better."""

    num_items: int

    def score(self, histories: Sequence[Sequence[int]]) -> np.ndarray:
        """(n, num_items + 1) float32; column 0 is padding and is ignored by callers."""
        ...


def chunks(n: int, size: int) -> Iterator[slice]:
    """Consecutive slices of at most `size` covering range(n)."""
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def _progress(n: int, chunk_size: int, desc: str | None):
    return tqdm(chunks(n, chunk_size), total=(n + chunk_size - 1) // chunk_size, desc=desc, disable=desc is None, leave=False)


def full_ranking_ranks(
    scorer: Scorer,
    histories: Sequence[Sequence[int]],
    targets: np.ndarray,
    *,
    chunk_size: int = 2048,
    desc: str | None = None,
) -> np.ndarray:
    """0-based rank of each target among all items not in its history.

    Args:
        histories: n item-id lists (the user's past, excluded from the ranking).
        targets: (n,) int item ids.
    Returns:
        (n,) int64 ranks.
    """
    out = np.empty(len(targets), dtype=np.int64)
    for sl in _progress(len(targets), chunk_size, desc):
        hist = histories[sl]
        out[sl] = target_rank_full(scorer.score(hist), targets[sl], hist)
    return out


def evaluate_full_ranking(
    scorer: Scorer,
    histories: Sequence[Sequence[int]],
    targets: np.ndarray,
    *,
    ks: Sequence[int] = (5, 10),
    chunk_size: int = 2048,
    desc: str | None = None,
) -> dict[str, float]:
    """Recall@k and NDCG@k over the full catalogue (the TIGER/SASRec protocol)."""
    ranks = full_ranking_ranks(scorer, histories, targets, chunk_size=chunk_size, desc=desc)
    return ranking_metrics(ranks, ks, ks)


def top_k(
    scorer: Scorer,
    histories: Sequence[Sequence[int]],
    k: int,
    *,
    chunk_size: int = 2048,
    desc: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The k best items per history, excluding padding and the history's own items.

    Returns:
        ids: (n, k) int64 item ids, best first.
        scores: (n, k) float32 their scores.
    """
    n = len(histories)
    ids = np.empty((n, k), dtype=np.int64)
    vals = np.empty((n, k), dtype=np.float32)
    for sl in _progress(n, chunk_size, desc):
        hist = histories[sl]
        s = np.array(scorer.score(hist), dtype=np.float32, copy=True)
        s[:, 0] = -np.inf
        for i, h in enumerate(hist):
            if len(h):
                s[i, np.asarray(h, dtype=np.int64)] = -np.inf
        part = np.argpartition(-s, k, axis=1)[:, :k]
        part_scores = np.take_along_axis(s, part, axis=1)
        # Stable order on ties (item id) so candidate lists are reproducible.
        order = np.lexsort((part, -part_scores), axis=1)
        ids[sl] = np.take_along_axis(part, order, axis=1)
        vals[sl] = np.take_along_axis(part_scores, order, axis=1)
    return ids, vals


ScorerFactory = Callable[[Sequence[Sequence[int]]], Scorer]
"""Fits a scorer on training sequences (used for cross-fitting over user folds)."""
