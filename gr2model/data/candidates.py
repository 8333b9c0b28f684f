"""Examples and K-candidate lists for the re-ranking task.

The pre-ranker (retriever) turns each (history, target) example into its top-K
candidates in its own order (the "incoming order"); an example whose target is
among them is a re-ranking example. Training examples come from positions inside
the training part of each sequence, and their lists are cross-fitted over user
folds so that the re-ranker never trains on lists from a pre-ranker that has
already seen the example's target (those lists would be unrealistically easy).

Input `split` frames have one row per user with columns `user_id` (Int64),
`train` (List[Int64], oldest first), `valid` (Int64) and `test` (Int64): the
leave-one-out split (last item test, the one before validation).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
import polars as pl

from gr2model.task.metrics import rank_in_lists, ranking_metrics
from gr2model.retrieval.scoring import Scorer, top_k

logger = logging.getLogger(__name__)

EXAMPLE_COLUMNS = ("user_id", "position", "history", "target")


def training_positions(
    split: pl.DataFrame, *, min_history: int = 1, positions_per_user: int = 0
) -> pl.DataFrame:
    """Next-item examples inside the training part of each user's sequence.

    For each 0-based position t of `train` with t >= min_history: history =
    train[:t], target = train[t]. With positions_per_user > 0 only the last that
    many positions of each user are kept (0 keeps all); the last positions have
    the longest histories and are closest in time to the evaluation targets.

    Returns:
        columns user_id (Int64), position (Int64), history (List[Int64]),
        target (Int64); users in `split` order, positions increasing.
    """
    if min_history < 0 or positions_per_user < 0:
        raise ValueError("min_history and positions_per_user must be >= 0")
    length = pl.col("train").list.len().cast(pl.Int64)
    start = pl.lit(min_history, dtype=pl.Int64)
    if positions_per_user > 0:
        start = pl.max_horizontal(start, length - positions_per_user)
    return (
        split.select(
            pl.col("user_id").cast(pl.Int64),
            pl.col("train").cast(pl.List(pl.Int64)),
            position=pl.int_ranges(start, length, dtype=pl.Int64),
        )
        .explode("position")
        # Users with no usable position explode to one null row.
        .drop_nulls("position")
        .select(
            "user_id",
            "position",
            history=pl.col("train").list.slice(0, pl.col("position")),
            target=pl.col("train").list.get(pl.col("position")),
        )
    )


def eval_examples(split: pl.DataFrame, which: Literal["valid", "test"]) -> pl.DataFrame:
    """One evaluation example per user.

    valid: history = train, target = valid; test: history = train + [valid],
    target = test. position is the target's index in the full sequence.

    Returns:
        columns user_id (Int64), position (Int64), history (List[Int64]), target (Int64).
    """
    train = pl.col("train").cast(pl.List(pl.Int64))
    if which == "valid":
        history = train
    elif which == "test":
        history = pl.concat_list(train, pl.col("valid").cast(pl.Int64))
    else:
        raise ValueError(f"which must be 'valid' or 'test', got {which!r}")
    return split.select(
        pl.col("user_id").cast(pl.Int64),
        position=history.list.len().cast(pl.Int64),
        history=history,
        target=pl.col(which).cast(pl.Int64),
    )


def user_folds(user_ids: np.ndarray, n_folds: int, seed: int) -> np.ndarray:
    """Seeded random, balanced fold of each user.

    Folds are assigned to the distinct ids (sorted, so the result does not depend
    on the order or repetition of `user_ids`): a seeded permutation of them is
    dealt round-robin, so fold sizes over distinct users differ by at most one.
    Repeated ids (several examples of one user) get the same fold.

    Args:
        user_ids: (n,) int user ids, repeats allowed.
    Returns:
        (n,) int64 fold index in 0..n_folds-1.
    """
    if n_folds < 1:
        raise ValueError("n_folds must be >= 1")
    unique, inverse = np.unique(np.asarray(user_ids), return_inverse=True)
    perm = np.random.default_rng(seed).permutation(len(unique))
    fold_of_unique = np.empty(len(unique), dtype=np.int64)
    fold_of_unique[perm] = np.arange(len(unique)) % n_folds
    return fold_of_unique[inverse.ravel()]


def candidate_lists(
    scorer: Scorer,
    examples: pl.DataFrame,
    k: int,
    *,
    chunk_size: int = 2048,
    desc: str | None = None,
) -> pl.DataFrame:
    """Add the scorer's top-k candidates to each example.

    Items of the example's history and padding (0) are never candidates, since a
    recommender must not return what the user already has.

    Args:
        examples: columns history (List[Int64]) and, optionally, target (Int64); n rows.
    Returns:
        `examples` plus candidates (List[Int64], k ids, best first), cand_scores
        (List[Float32], their scores) and, when there is a target, target_rank
        (Int64, 0-based index of the target in candidates, -1 when absent).
    """
    histories = examples["history"].to_list()
    t0 = time.perf_counter()
    ids, scores = top_k(scorer, histories, k, chunk_size=chunk_size, desc=desc)
    logger.info("candidate_lists: %d examples, k=%d in %.1fs", len(histories), k, time.perf_counter() - t0)
    if np.isneginf(scores).any():
        # top_k marks history items and padding with -inf, so a -inf candidate may
        # be one of them: the history (or the scorer) left fewer than k real options.
        raise ValueError(f"some example has fewer than k={k} items with a finite score outside its history")
    out = examples.with_columns(
        pl.Series("candidates", ids, dtype=pl.Array(pl.Int64, k)).cast(pl.List(pl.Int64)),
        pl.Series("cand_scores", scores, dtype=pl.Array(pl.Float32, k)).cast(pl.List(pl.Float32)),
    )
    if "target" in examples.columns:
        ranks = rank_in_lists(ids, examples["target"].to_numpy().astype(np.int64))
        out = out.with_columns(pl.Series("target_rank", ranks, dtype=pl.Int64))
    return out


def crossfit_candidate_lists(
    examples: pl.DataFrame,
    split: pl.DataFrame,
    fit: Callable[[list[list[int]], int], Scorer],
    n_folds: int,
    k: int,
    *,
    seed: int = 0,
) -> pl.DataFrame:
    """Honest candidate lists for training examples, cross-fitted over user folds.

    Users of `split` are dealt into n_folds folds (`user_folds`). For fold f,
    `fit(train_sequences, f)` gets the `train` sequences of the users NOT in f
    and returns a scorer, which then writes the lists of fold f's examples. No
    list therefore comes from a pre-ranker that saw that example's target.

    Args:
        examples: columns user_id, history and target (e.g. `training_positions`);
            every user_id must be in `split`.
        split: the leave-one-out split, one row per user.
        fit: (train sequences, fold index) -> Scorer.
    Returns:
        `examples` in their original order with candidates, cand_scores,
        target_rank (as `candidate_lists`) and fold (Int64).
    """
    if n_folds < 2:
        raise ValueError("cross-fitting needs n_folds >= 2")
    user_ids = split["user_id"].cast(pl.Int64).to_numpy()
    folds = pl.DataFrame(
        {"user_id": user_ids, "fold": user_folds(user_ids, n_folds, seed)},
        schema={"user_id": pl.Int64, "fold": pl.Int64},
    )
    row = "__crossfit_row"
    tagged = examples.with_row_index(row).join(folds, on="user_id", how="left", maintain_order="left")
    if tagged["fold"].null_count():
        raise ValueError(f"{tagged['fold'].null_count()} examples have a user_id that is not in the split")
    split_fold = split.select(pl.col("user_id").cast(pl.Int64), "train").join(
        folds, on="user_id", how="left", maintain_order="left"
    )
    parts: list[pl.DataFrame] = []
    for f in range(n_folds):
        t0 = time.perf_counter()
        fit_seqs = split_fold.filter(pl.col("fold") != f)["train"].to_list()
        scorer = fit(fit_seqs, f)
        t_fit = time.perf_counter() - t0
        fold_examples = tagged.filter(pl.col("fold") == f)
        parts.append(candidate_lists(scorer, fold_examples, k, desc=f"fold {f}"))
        logger.info(
            "crossfit fold %d/%d: fit on %d sequences in %.1fs, %d lists in %.1fs",
            f + 1, n_folds, len(fit_seqs), t_fit, fold_examples.height, time.perf_counter() - t0 - t_fit,
        )
    # Back to the caller's row order; the fold column goes last.
    out = pl.concat(parts).sort(row).drop(row)
    return out.select([c for c in out.columns if c != "fold"] + ["fold"])


def rerank_metrics(lists: pl.DataFrame) -> dict[str, float]:
    """Metrics of the pre-rank (incoming) order on the re-ranking examples.

    Re-ranking examples are those with target_rank >= 0 (the target is among the
    candidates); the others cannot be fixed by any re-ranker.

    Args:
        lists: a column target_rank (Int64, -1 when the target is absent).
    Returns:
        recall@1/3/5, ndcg@3/5 over the re-ranking examples, n (their number),
        n_examples (all rows) and coverage = n / n_examples.
    """
    all_ranks = lists["target_rank"].to_numpy().astype(np.int64)
    ranks = all_ranks[all_ranks >= 0]
    out = ranking_metrics(ranks, (1, 3, 5), (3, 5))
    out["n_examples"] = int(all_ranks.size)
    out["coverage"] = float(ranks.size / all_ranks.size) if all_ranks.size else 0.0
    return out


def write_parquet_atomic(df: pl.DataFrame, path: Path) -> None:
    """Write `df` to `path` so that readers see either the old file or the whole new one.

    The frame is written to a temporary name in the same folder (same file
    system, so os.replace is atomic) and renamed; on any error the temporary
    file is removed and the error re-raised.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        df.write_parquet(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
