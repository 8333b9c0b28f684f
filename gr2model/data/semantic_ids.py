"""Semantic ids built from the training data when none are given.

An item's semantic id is a short tuple of codes that the language model reads and
writes as tokens. Items that behave alike should share a prefix, so that the model
can generalise across them, and every full id must name exactly one item.

Recipe (TIGER-style residual quantisation, without a text encoder):
1. `item_embeddings`: one vector per item from what the training data says about
   it: which items it appears next to in users' sequences (PPMI of a windowed
   co-occurrence matrix) and which attributes it carries (tf-idf), each reduced
   by truncated SVD, concatenated, rows L2-normalised.
2. `residual_kmeans`: k-means on the vectors gives code 1; k-means on what is
   left after subtracting each vector's centroid gives code 2, and so on.
3. `add_collision_code`: a last code numbers the items that still share all
   earlier codes (0, 1, 2, ... in item-id order), so every id is unique.

Only training interactions go in (the caller passes the leave-one-out train
parts): the ids must not encode which item a user picks next in validation/test.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from sklearn.decomposition import TruncatedSVD
from threadpoolctl import threadpool_limits  # installed with scikit-learn

# The BLAS work here is mostly thin products (n x 64 by 64 x a few): threaded
# OpenBLAS makes them up to 10x slower on a loaded 2-core machine, and a fixed
# thread count also keeps results bit-identical from one machine to the next.
_ONE_BLAS_THREAD = {"limits": 1, "user_api": "blas"}

__all__ = [
    "item_embeddings",
    "residual_kmeans",
    "add_collision_code",
    "prefix_unique_share",
    "build_semantic_ids",
]


def _cooccurrence(train_sequences: list[list[int]], num_items: int, window: int) -> sp.csr_matrix:
    """Symmetric (num_items + 1, num_items + 1) counts of item pairs at most `window`
    positions apart in one sequence, weighted 1/distance (near neighbours say more)."""
    lengths = np.fromiter((len(s) for s in train_sequences), dtype=np.int64, count=len(train_sequences))
    if lengths.sum() == 0:
        return sp.csr_matrix((num_items + 1, num_items + 1), dtype=np.float64)
    flat = np.fromiter((i for s in train_sequences for i in s), dtype=np.int64, count=int(lengths.sum()))
    seq = np.repeat(np.arange(len(train_sequences)), lengths)
    rows, cols, vals = [], [], []
    for d in range(1, window + 1):
        # Vectorised over all sequences at once: pair position p with p + d and keep
        # the pairs that stay inside one sequence.
        same = seq[:-d] == seq[d:]
        a, b = flat[:-d][same], flat[d:][same]
        keep = a != b  # an item next to itself says nothing about similarity
        a, b = a[keep], b[keep]
        w = np.full(a.shape[0], 1.0 / d)
        rows += [a, b]
        cols += [b, a]
        vals += [w, w]
    m = sp.coo_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
        shape=(num_items + 1, num_items + 1),
    )
    return m.tocsr()  # sums duplicate pairs


def _ppmi(m: sp.csr_matrix, alpha: float = 0.75) -> sp.csr_matrix:
    """Positive pointwise mutual information of a symmetric count matrix, with the
    context distribution smoothed by `alpha` (Levy et al. 2015) so rare items do not
    get huge PMI values from a single co-occurrence."""
    m = m.tocoo()
    total = m.sum()
    if total == 0:
        return sp.csr_matrix(m.shape)
    row = np.asarray(m.sum(axis=1)).ravel()
    ctx = row**alpha
    ctx = ctx / ctx.sum()
    pmi = np.log(m.data / total) - np.log(row[m.row] / total) - np.log(ctx[m.col])
    keep = pmi > 0
    return sp.csr_matrix((pmi[keep], (m.row[keep], m.col[keep])), shape=m.shape)


def _tfidf_attributes(attributes: dict[int, list[int]], num_items: int) -> sp.csr_matrix:
    """(num_items + 1, max_attribute + 1) item-attribute incidence weighted by idf, so
    an attribute that nearly every item has (the category "Beauty") counts little."""
    rows = [i for i, attrs in attributes.items() if 0 < i <= num_items for _ in set(attrs)]
    cols = [a for i, attrs in attributes.items() if 0 < i <= num_items for a in set(attrs)]
    n_attr = (max(cols) + 1) if cols else 1
    m = sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(num_items + 1, n_attr))
    df = np.asarray((m > 0).sum(axis=0)).ravel()
    n_with = max(int((np.diff(m.indptr) > 0).sum()), 1)
    idf = np.log((1 + n_with) / (1 + df)) + 1.0
    return (m @ sp.diags(idf)).tocsr()


def _svd(m: sp.csr_matrix, dim: int, seed: int) -> np.ndarray:
    """(rows, dim) float64: left singular vectors scaled by sqrt(singular values),
    zero-padded when the matrix has fewer than dim + 1 useful columns; rows L2-normalised
    (zero rows stay zero)."""
    out = np.zeros((m.shape[0], dim))
    k = min(dim, min(m.shape) - 1)
    if k >= 1 and m.nnz > 0:
        svd = TruncatedSVD(n_components=k, algorithm="randomized", n_iter=5, random_state=seed)
        u = svd.fit_transform(m)  # = U * S
        out[:, :k] = u / np.sqrt(np.maximum(svd.singular_values_, 1e-12))
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    return np.divide(out, norms, out=np.zeros_like(out), where=norms > 0)


def item_embeddings(
    train_sequences: list[list[int]],
    attributes: dict[int, list[int]],
    num_items: int,
    *,
    dim: int = 64,
    window: int = 3,
    seed: int = 0,
) -> np.ndarray:
    """Item vectors from training co-occurrence and attributes.

    Args:
        train_sequences: per user, the training items (ids in 1..num_items), oldest first.
        attributes: item id -> attribute ids (items missing from it have none).
        num_items: largest item id.
        dim: output width; half from co-occurrence, half from attributes.
        window: items at most this many positions apart count as co-occurring.
        seed: seeds the randomised SVD and the fallback vectors.

    Returns:
        (num_items + 1, dim) float32, rows L2-normalised; row 0 (padding) is zeros.
        An item with neither co-occurrences nor attributes gets a deterministic random
        unit vector, so such items spread over codes instead of all sharing one.
    """
    if dim < 2:
        raise ValueError(f"dim must be at least 2, got {dim}")
    d_co = dim // 2
    with threadpool_limits(**_ONE_BLAS_THREAD):
        co = _svd(_ppmi(_cooccurrence(train_sequences, num_items, window)), d_co, seed)
        at = _svd(_tfidf_attributes(attributes, num_items), dim - d_co, seed)
    # Both halves are unit rows, so each signal carries equal weight when present.
    x = np.concatenate([co, at], axis=1)
    norms = np.linalg.norm(x, axis=1)
    empty = np.flatnonzero(norms == 0)
    empty = empty[empty > 0]
    if empty.size:
        rng = np.random.default_rng(seed)
        x[empty] = rng.standard_normal((empty.size, dim))
        norms[empty] = np.linalg.norm(x[empty], axis=1)
    x[1:] /= norms[1:, None]
    x[0] = 0.0
    return x.astype(np.float32)


def _sq_dists(x: np.ndarray, xx: np.ndarray, c: np.ndarray) -> np.ndarray:
    """(n, k) squared Euclidean distances from x (n, d) to c (k, d), given xx = |x|^2
    per row (computed once by the caller: it is the same at every step); clipped at 0
    against rounding."""
    d = xx[:, None] - 2.0 * (x @ c.T) + (c * c).sum(1)[None, :]
    return np.maximum(d, 0.0)


def _kmeans(x: np.ndarray, k: int, *, seed: int, iters: int) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd's k-means with greedy k-means++ seeding.

    Written out (rather than sklearn's KMeans) because sklearn's threaded Lloyd step
    adds per-thread partial sums in completion order, which can flip a near-tie
    between runs; here the same input and seed give the same codes.

    Returns (labels (n,) int64, centroids (k, d) float64); the centroids are the
    means of their final members.
    """
    n = x.shape[0]
    xx = (x * x).sum(1)
    rng = np.random.default_rng(seed)
    trials = 2 + int(np.log(k))
    centers = np.empty((k, x.shape[1]))
    centers[0] = x[rng.integers(n)]
    closest = _sq_dists(x, xx, centers[:1])[:, 0]
    for j in range(1, k):
        total = closest.sum()
        if total <= 0:  # fewer distinct points than k: any point will do
            cand = rng.integers(n, size=trials)
        else:
            cand = np.searchsorted(np.cumsum(closest), rng.random(trials) * total)
            cand = np.minimum(cand, n - 1)
        cand_d = np.minimum(closest[:, None], _sq_dists(x, xx, x[cand]))
        best = int(np.argmin(cand_d.sum(0)))
        centers[j] = x[cand[best]]
        closest = cand_d[:, best]
    labels = np.full(n, -1, dtype=np.int64)
    for _ in range(iters):
        d = _sq_dists(x, xx, centers)
        new = d.argmin(1)
        if np.array_equal(new, labels):
            break
        labels = new
        # Cluster sums as a (k, n) one-hot sparse product: much faster than np.add.at.
        onehot = sp.csr_matrix((np.ones(n), (labels, np.arange(n))), shape=(k, n))
        counts = np.bincount(labels, minlength=k)
        sums = onehot @ x
        nonempty = counts > 0
        centers[nonempty] = sums[nonempty] / counts[nonempty, None]
        # An empty cluster takes the point worst served by its centroid, so the
        # codebook stays fully used.
        for j in np.flatnonzero(~nonempty):
            far = int(np.argmax(d[np.arange(n), labels]))
            centers[j] = x[far]
            d[far, labels[far]] = 0.0
    return labels, centers


def residual_kmeans(
    x: np.ndarray,
    *,
    levels: int = 3,
    codebook_size: int = 256,
    seed: int = 0,
    iters: int = 25,
) -> np.ndarray:
    """Residual k-means codes.

    Args:
        x: (n, d) vectors.
        levels: number of codes per vector.
        codebook_size: centroids per level, clipped to n.
        seed: level l uses seed + l.
        iters: Lloyd iterations per level at most.

    Returns:
        (n, levels) int64 in [0, min(codebook_size, n)); level l clusters
        x minus the sum of the centroids chosen at levels 0..l-1.
    """
    n = x.shape[0]
    codes = np.zeros((n, levels), dtype=np.int64)
    if n == 0:
        return codes
    k = min(codebook_size, n)
    residual = np.asarray(x, dtype=np.float64).copy()
    with threadpool_limits(**_ONE_BLAS_THREAD):
        for level in range(levels):
            labels, centers = _kmeans(residual, k, seed=seed + level, iters=iters)
            codes[:, level] = labels
            residual -= centers[labels]
    return codes


def add_collision_code(codes: np.ndarray) -> np.ndarray:
    """(n, levels) -> (n, levels + 1): the extra code is the rank of each row among
    rows with the same codes, in row order (0 for the first, 1 for the next, ...).
    Rows are expected in item-id order so the numbering is stable."""
    n, levels = codes.shape
    out = np.zeros((n, levels + 1), dtype=np.int64)
    out[:, :levels] = codes
    if n == 0:
        return out
    _, group = np.unique(codes, axis=0, return_inverse=True)
    group = group.reshape(-1)
    order = np.argsort(group, kind="stable")  # stable keeps row order inside a group
    g = group[order]
    starts = np.r_[0, np.flatnonzero(np.diff(g)) + 1]
    sizes = np.diff(np.r_[starts, n])
    rank = np.arange(n) - np.repeat(starts, sizes)
    out[order, levels] = rank
    return out


def prefix_unique_share(codes: np.ndarray, levels: int = 3) -> float:
    """Share of rows whose first `levels` codes no other row has. codes: (n, >= levels)."""
    if codes.shape[0] == 0:
        return 1.0
    _, inv, counts = np.unique(codes[:, :levels], axis=0, return_inverse=True, return_counts=True)
    return float((counts[inv.reshape(-1)] == 1).mean())


def build_semantic_ids(
    train_sequences: list[list[int]],
    attributes: dict[int, list[int]],
    item_ids: np.ndarray,
    *,
    dim: int = 64,
    levels: int = 3,
    codebook_size: int = 256,
    seed: int = 0,
) -> tuple[np.ndarray, dict[str, float]]:
    """Unique semantic ids for `item_ids`.

    Args:
        train_sequences: per user, training items only (leave-one-out train parts).
        attributes: item id -> attribute ids.
        item_ids: (n,) distinct positive item ids to code.

    Returns:
        codes: (n, levels + 1) int64, row i for item_ids[i]; the first `levels` codes
            in [0, codebook_size), the last a collision index numbered in item-id order.
        stats: sid_prefix_unique_share (share of items unique on the first `levels`
            codes), sid_unique_share (1.0 by construction, computed), max_collision_code.
    """
    item_ids = np.asarray(item_ids, dtype=np.int64)
    if item_ids.size and (item_ids.min() < 1 or np.unique(item_ids).size != item_ids.size):
        raise ValueError("item_ids must be distinct positive ids")
    num_items = int(max([item_ids.max(initial=0)] + [max(s, default=0) for s in train_sequences]))
    emb = item_embeddings(train_sequences, attributes, num_items, dim=dim, seed=seed)
    # Code in item-id order so the collision index is numbered by item id, then
    # put the rows back in the caller's order.
    order = np.argsort(item_ids, kind="stable")
    sorted_codes = add_collision_code(
        residual_kmeans(emb[item_ids[order]], levels=levels, codebook_size=codebook_size, seed=seed)
    )
    codes = np.empty_like(sorted_codes)
    codes[order] = sorted_codes
    stats = {
        "sid_prefix_unique_share": prefix_unique_share(codes, levels),
        "sid_unique_share": prefix_unique_share(codes, levels + 1),
        "max_collision_code": float(codes[:, levels].max(initial=0)),
    }
    return codes, stats
