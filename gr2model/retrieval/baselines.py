"""Non-neural pre-rankers (popularity, item-to-item transitions) and score ensembles.

They serve as baselines for the retriever and as a signal that can be added to
SASRec's log-probabilities: on Amazon Beauty, where most users have fewer than
ten interactions, "what usually follows the last item" is a strong predictor.
Every scorer here follows `gr2model.retrieval.scoring.Scorer` and returns finite
log-probabilities (never -inf), so scores can be added and weighted, including
with weight 0, without producing NaN.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp
from tqdm.auto import tqdm

from gr2model.task.metrics import ranking_metrics, target_rank_full
from gr2model.retrieval.scoring import Scorer, chunks

logger = logging.getLogger(__name__)

# Added inside the log so that items with zero probability (padding, items never
# seen in training) get a finite, very low score instead of -inf.
_EPS = 1e-12


def _popularity_distribution(train_sequences: Sequence[Sequence[int]], num_items: int) -> np.ndarray:
    """Add-one smoothed item frequencies, (num_items + 1,) float64, entry 0 (padding) = 0.

    Add-one keeps every real item strictly positive so a popularity prior never
    leaves an item at probability zero.
    """
    flat = np.fromiter((i for seq in train_sequences for i in seq), dtype=np.int64)
    if flat.size and (flat.min() < 1 or flat.max() > num_items):
        raise ValueError(f"item ids must lie in 1..{num_items}, got {flat.min()}..{flat.max()}")
    counts = np.bincount(flat, minlength=num_items + 1).astype(np.float64)
    counts[0] = 0.0
    smoothed = counts + 1.0
    smoothed[0] = 0.0
    return smoothed / smoothed.sum()


class PopularityScorer:
    """Scores each item by how often it occurs in the training sequences.

    The score is the log of the add-one smoothed frequency: the same order as
    the raw counts, but on the log-probability scale of the other scorers so it
    can be ensembled with them.
    """

    def __init__(self, train_sequences: Sequence[Sequence[int]], num_items: int):
        self.num_items = num_items
        self.counts = np.bincount(
            np.fromiter((i for seq in train_sequences for i in seq), dtype=np.int64),
            minlength=num_items + 1,
        )[: num_items + 1]
        self.log_prob = np.log(_popularity_distribution(train_sequences, num_items) + _EPS).astype(np.float32)

    def score(self, histories: Sequence[Sequence[int]]) -> np.ndarray:
        """(n, num_items + 1) float32: the same popularity row for every history."""
        return np.broadcast_to(self.log_prob, (len(histories), self.num_items + 1)).copy()


class TransitionScorer:
    """First-order item-to-item transitions with a popularity prior.

    Fitting counts C[a, b] = number of times item b came d = 1..`window` steps
    after item a in a training sequence, each weighted window_decay**(d - 1)
    (window 1 = direct successors only), and turns each row into a
    Dirichlet-smoothed conditional distribution around the popularity prior p:

        P(b | a) = (C[a, b] + smoothing * p(b)) / (n_a + smoothing),   n_a = sum_b C[a, b]

    A pseudo-count prior (rather than a fixed mixture weight) trusts a row in
    proportion to its evidence: items seen after `a` hundreds of times barely
    feel the prior, an item with two observed successors leans on popularity,
    and an item with no successors at all (n_a = 0) falls back to p exactly.

    Scoring mixes the rows of the last `last_n` history items, most recent first,
    with weights decay**j normalised to sum to 1, so the result is a proper
    distribution over items; an empty history gets p. It returns
    log(P + 1e-12), a log-probability that can be added to another scorer's.

    On Amazon Beauty (counts from items[:-2], tuned on validation NDCG@10) the
    best settings were last_n=10, decay=0.6, window=10, window_decay=0.8,
    smoothing=75 (valid NDCG@10 0.069 against 0.062 for the defaults):
    skip-transitions (window > 1) and a strong prior both help because most
    items have only a handful of observed successors.
    """

    def __init__(
        self,
        train_sequences: Sequence[Sequence[int]],
        num_items: int,
        *,
        last_n: int = 3,
        decay: float = 0.5,
        window: int = 1,
        smoothing: float = 20.0,
        window_decay: float = 1.0,
    ):
        if last_n < 1 or window < 1:
            raise ValueError("last_n and window must be >= 1")
        if not 0.0 < decay <= 1.0:
            raise ValueError("decay must lie in (0, 1]")
        if not 0.0 < window_decay <= 1.0:
            raise ValueError("window_decay must lie in (0, 1]")
        if smoothing <= 0.0:
            raise ValueError("smoothing must be > 0 (it keeps every score finite and breaks ties)")
        self.num_items = num_items
        self.last_n = last_n
        self.decay = decay
        self.window = window
        self.smoothing = smoothing
        self.window_decay = window_decay
        v = num_items + 1
        self.prior = _popularity_distribution(train_sequences, num_items).astype(np.float32)

        rows: list[np.ndarray] = []
        cols: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        for seq in train_sequences:
            s = np.asarray(seq, dtype=np.int64)
            for d in range(1, min(window, len(s) - 1) + 1):
                rows.append(s[:-d])
                cols.append(s[d:])
                vals.append(np.full(len(s) - d, window_decay ** (d - 1), dtype=np.float32))
        r = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        c = np.concatenate(cols) if cols else np.zeros(0, dtype=np.int64)
        x = np.concatenate(vals) if vals else np.zeros(0, dtype=np.float32)
        # COO -> CSR sums duplicate (a, b) pairs, which is exactly the count.
        counts = sp.coo_matrix((x, (r, c)), shape=(v, v)).tocsr()
        counts.sum_duplicates()
        self.counts: sp.csr_matrix = counts
        self.row_totals = np.asarray(counts.sum(axis=1)).ravel().astype(np.float32)  # n_a, (v,)
        denom = self.row_totals + np.float32(smoothing)
        # M[a, b] = C[a, b] / (n_a + smoothing); the prior's share of row a is prior_share[a].
        self.transition: sp.csr_matrix = sp.diags(1.0 / denom).dot(counts).tocsr().astype(np.float32)
        self.prior_share = (np.float32(smoothing) / denom).astype(np.float32)  # (v,)
        logger.info(
            "TransitionScorer: %d distinct (a, b) pairs, total weight %.0f, %d items with successors",
            counts.nnz, float(counts.sum()), int((self.row_totals > 0).sum()),
        )

    def _history_weights(self, histories: Sequence[Sequence[int]]) -> sp.csr_matrix:
        """(n, num_items + 1) sparse: normalised weights of each history's last `last_n` items."""
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        base = self.decay ** np.arange(self.last_n)
        for i, h in enumerate(histories):
            recent = list(h[-self.last_n :])[::-1]  # most recent first
            if not recent:
                continue
            w = base[: len(recent)] / base[: len(recent)].sum()
            rows.extend([i] * len(recent))
            cols.extend(int(a) for a in recent)
            vals.extend(w.tolist())
        return sp.csr_matrix(
            (np.asarray(vals, dtype=np.float32), (np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64))),
            shape=(len(histories), self.num_items + 1),
        )

    def score(self, histories: Sequence[Sequence[int]]) -> np.ndarray:
        """(n, num_items + 1) float32 log-probabilities of the next item."""
        weights = self._history_weights(histories)
        prior_coef = np.asarray(weights.dot(self.prior_share)).ravel()  # (n,)
        prior_coef[np.asarray(weights.sum(axis=1)).ravel() == 0] = 1.0  # empty history -> prior
        probs = weights.dot(self.transition).toarray().astype(np.float32, copy=False)
        probs += prior_coef[:, None].astype(np.float32) * self.prior[None, :]
        np.log(probs + np.float32(_EPS), out=probs)
        return probs


class EnsembleScorer:
    """Weighted sum of scorers: sum_i weights[i] * scorers[i].score(h).

    A scorer with weight 0 is not called at all, so weight 0 reproduces the
    others exactly even if that scorer returns -inf somewhere (0 * -inf = NaN).
    """

    def __init__(self, scorers: Sequence[Scorer], weights: Sequence[float]):
        if len(scorers) != len(weights) or not scorers:
            raise ValueError("need one weight per scorer and at least one scorer")
        sizes = {s.num_items for s in scorers}
        if len(sizes) != 1:
            raise ValueError(f"scorers disagree on num_items: {sizes}")
        self.scorers = list(scorers)
        self.weights = [float(w) for w in weights]
        self.num_items = sizes.pop()

    def score(self, histories: Sequence[Sequence[int]]) -> np.ndarray:
        """(n, num_items + 1) float32 weighted sum of the member scores."""
        out = np.zeros((len(histories), self.num_items + 1), dtype=np.float32)
        for scorer, w in zip(self.scorers, self.weights):
            if w != 0.0:
                out += np.float32(w) * np.asarray(scorer.score(histories), dtype=np.float32)
        return out


def tune_weight(
    base: Scorer,
    other: Scorer,
    histories: Sequence[Sequence[int]],
    targets: np.ndarray,
    grid: Sequence[float],
    *,
    metric: str = "ndcg@10",
    chunk_size: int = 2048,
) -> tuple[float, dict[float, dict[str, float]]]:
    """Choose w for EnsembleScorer([base, other], [1.0, w]) by full-ranking `metric`.

    Use validation examples only: the chosen weight is then reported on test.
    Each chunk is scored once per scorer and reused for every w in the grid.

    Args:
        histories: n item-id lists (excluded from the ranking).
        targets: (n,) int item ids.
        grid: candidate weights; ties go to the earliest in the grid.
        metric: a key of `ranking_metrics`, e.g. "ndcg@10" or "recall@5".
    Returns:
        the best w, and {w: {"recall@k", "ndcg@k" for k in 5, 10 and the metric's k, "n"}}.
    """
    if not grid:
        raise ValueError("empty grid")
    name, _, k_str = metric.partition("@")
    if name not in ("recall", "ndcg") or not k_str.isdigit():
        raise ValueError(f"metric must look like 'ndcg@10' or 'recall@5', got {metric!r}")
    ks = sorted({5, 10, int(k_str)})
    targets = np.asarray(targets, dtype=np.int64)
    n = len(targets)
    ranks = {float(w): np.empty(n, dtype=np.int64) for w in grid}
    n_chunks = (n + chunk_size - 1) // chunk_size
    for sl in tqdm(chunks(n, chunk_size), total=n_chunks, desc="tune_weight", leave=False):
        hist = histories[sl]
        s_base = np.asarray(base.score(hist), dtype=np.float32)
        s_other = np.asarray(other.score(hist), dtype=np.float32)
        for w in ranks:
            combined = s_base if w == 0.0 else s_base + np.float32(w) * s_other
            ranks[w][sl] = target_rank_full(combined, targets[sl], hist)
    table = {w: ranking_metrics(r, ks, ks) for w, r in ranks.items()}
    best = max(table, key=lambda w: table[w][metric])  # max() keeps the first of equal values
    for w, m in table.items():
        logger.info("tune_weight w=%g %s=%.4f%s", w, metric, m[metric], "  <- best" if w == best else "")
    return best, table
