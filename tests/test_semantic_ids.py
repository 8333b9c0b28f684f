"""Tests of gr2model.data.semantic_ids: residual k-means ids built from training data."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from gr2model.data.semantic_ids import (
    add_collision_code,
    build_semantic_ids,
    item_embeddings,
    prefix_unique_share,
    residual_kmeans,
)


def synthetic(num_items: int = 240, users: int = 400, groups: int = 8, seed: int = 0) -> tuple[
    list[list[int]], dict[int, list[int]]
]:
    """Items in `groups` taste groups: each user mostly browses one group; each item
    carries its group's attribute plus a random one."""
    rng = np.random.default_rng(seed)
    group_of = np.arange(1, num_items + 1) % groups
    seqs = []
    for _ in range(users):
        g = rng.integers(groups)
        pool = np.flatnonzero(group_of == g) + 1
        seqs.append([int(i) for i in rng.choice(pool, size=rng.integers(3, 10))])
    attrs = {i: [int(group_of[i - 1]) + 1, int(rng.integers(groups + 1, groups + 20))] for i in range(1, num_items + 1)}
    return seqs, attrs


def test_add_collision_code_hand_example() -> None:
    codes = np.array([[1, 2, 3], [0, 0, 0], [1, 2, 3], [1, 2, 3], [0, 0, 1], [0, 0, 0]])
    out = add_collision_code(codes)
    assert out.shape == (6, 4) and out.dtype == np.int64
    assert out[:, :3].tolist() == codes.tolist()
    assert out[:, 3].tolist() == [0, 0, 1, 2, 0, 1]
    assert prefix_unique_share(out, 4) == 1.0
    assert prefix_unique_share(codes, 3) == pytest.approx(1 / 6)
    assert prefix_unique_share(codes, 2) == pytest.approx(0.0)


def test_residual_kmeans_clusters_residuals() -> None:
    # x = coarse centre (scale 10) + fine offset (scale 1) + noise: level 0 must find
    # the coarse groups and level 1, working on what level 0 leaves, the fine ones.
    rng = np.random.default_rng(1)
    coarse = rng.standard_normal((4, 8)) * 10
    fine = rng.standard_normal((4, 8))
    a = rng.integers(4, size=400)
    b = rng.integers(4, size=400)
    x = coarse[a] + fine[b] + 0.01 * rng.standard_normal((400, 8))
    codes = residual_kmeans(x, levels=3, codebook_size=4, seed=0)
    assert codes.shape == (400, 3) and codes.dtype == np.int64
    for level, truth in ((0, a), (1, b)):
        pairs = set(zip(codes[:, level].tolist(), truth.tolist()))
        assert len(pairs) == 4, f"level {level} codes should match its true groups one to one"

    # reconstruction from the per-level cluster means falls with every level
    residual = x.copy()
    errors = [float((residual**2).sum())]
    for level in range(3):
        c = codes[:, level]
        means = np.stack([residual[c == j].mean(0) if (c == j).any() else np.zeros(8) for j in range(4)])
        residual = residual - means[c]
        errors.append(float((residual**2).sum()))
    assert all(e1 < e0 for e0, e1 in zip(errors, errors[1:]))
    assert errors[2] < 0.05 * errors[1]


def test_residual_kmeans_clips_codebook() -> None:
    x = np.random.default_rng(0).standard_normal((5, 3))
    codes = residual_kmeans(x, levels=2, codebook_size=256, seed=0)
    assert codes.max() < 5
    assert sorted(codes[:, 0].tolist()) == [0, 1, 2, 3, 4]  # 5 points, 5 centroids


def test_item_embeddings_shape_and_signal() -> None:
    seqs, attrs = synthetic()
    # item 250 has no sequence and no attributes; 251 and 252 neither
    emb = item_embeddings(seqs, attrs, 252, dim=16, seed=0)
    assert emb.shape == (253, 16) and emb.dtype == np.float32
    assert not emb[0].any()
    np.testing.assert_allclose(np.linalg.norm(emb[1:], axis=1), 1.0, rtol=1e-5)
    assert np.abs(emb[250] - emb[251]).max() > 0.1  # no-signal items do not collapse
    # items of one taste group are more alike than items of different groups
    sims = emb[1:241] @ emb[1:241].T
    group = np.arange(1, 241) % 8
    same = group[:, None] == group[None, :]
    np.fill_diagonal(same, False)
    diff = group[:, None] != group[None, :]
    assert sims[same].mean() > sims[diff].mean() + 0.3
    np.testing.assert_array_equal(emb, item_embeddings(seqs, attrs, 252, dim=16, seed=0))


def test_build_semantic_ids_unique_deterministic_and_ordered() -> None:
    seqs, attrs = synthetic()
    ids = np.arange(1, 241)
    codes, stats = build_semantic_ids(seqs, attrs, ids, dim=16, codebook_size=8, seed=0)
    assert codes.shape == (240, 4) and codes.dtype == np.int64
    assert np.unique(codes, axis=0).shape[0] == 240
    assert codes[:, :3].max() < 8
    assert stats["sid_unique_share"] == 1.0
    assert stats["sid_prefix_unique_share"] == pytest.approx(prefix_unique_share(codes, 3))
    assert stats["max_collision_code"] == codes[:, 3].max()
    # collision index numbered in item-id order
    for key in {tuple(c) for c in codes[:, :3].tolist()}:
        members = np.flatnonzero((codes[:, :3] == key).all(1))
        assert codes[members, 3].tolist() == list(range(len(members)))

    again, _ = build_semantic_ids(seqs, attrs, ids, dim=16, codebook_size=8, seed=0)
    np.testing.assert_array_equal(codes, again)
    other, _ = build_semantic_ids(seqs, attrs, ids, dim=16, codebook_size=8, seed=1)
    assert not np.array_equal(codes, other)

    # the caller's order only permutes the rows
    perm = np.random.default_rng(0).permutation(240)
    shuffled, _ = build_semantic_ids(seqs, attrs, ids[perm], dim=16, codebook_size=8, seed=0)
    np.testing.assert_array_equal(shuffled, codes[perm])

    with pytest.raises(ValueError, match="distinct positive"):
        build_semantic_ids(seqs, attrs, np.array([1, 1, 2]))


def test_first_code_groups_similar_items() -> None:
    seqs, attrs = synthetic()
    codes, _ = build_semantic_ids(seqs, attrs, np.arange(1, 241), dim=16, codebook_size=8, seed=0)
    group = np.arange(1, 241) % 8
    # with 8 first codes and 8 groups, each first code should be dominated by one group
    purity = np.mean([np.bincount(group[codes[:, 0] == c]).max() / (codes[:, 0] == c).sum()
                      for c in np.unique(codes[:, 0])])
    assert purity > 0.8


def test_shared_beauty_semantic_ids(shared_data: Path) -> None:
    from gr2model.data.dataset import leave_one_out, load_sequence_dataset

    ds = load_sequence_dataset(shared_data, sid_file=None)
    train = leave_one_out(ds.sequences)["train"].to_list()
    attrs = ds.attribute_map()
    ids = ds.items["item_id"].to_numpy()
    t0 = time.perf_counter()
    codes, stats = build_semantic_ids(train, attrs, ids, seed=0)
    elapsed = time.perf_counter() - t0
    assert elapsed < 60, f"took {elapsed:.1f} s"
    assert np.unique(codes, axis=0).shape[0] == ids.size
    assert stats["sid_unique_share"] == 1.0
    assert stats["sid_prefix_unique_share"] > 0.8

    # Items that share a first code share more than one attribute far more often
    # than random pairs (the dataset README reports ~8x for its RQ-VAE ids).
    rng = np.random.default_rng(0)
    aset = [set(attrs[int(i)]) for i in ids]
    first = codes[:, 0]
    order = np.argsort(first, kind="stable")
    starts = np.searchsorted(first[order], first)
    counts = np.bincount(first)[first]
    i = rng.integers(ids.size, size=20_000)
    j = order[starts[i] + rng.integers(0, counts[i])]  # a random item with i's first code
    keep = i != j
    same_code = np.mean([len(aset[a] & aset[b]) > 1 for a, b in zip(i[keep], j[keep])])
    r1, r2 = rng.integers(ids.size, size=(2, 20_000))
    keep = r1 != r2
    random_pairs = np.mean([len(aset[a] & aset[b]) > 1 for a, b in zip(r1[keep], r2[keep])])
    assert same_code > 4 * random_pairs, (same_code, random_pairs)
