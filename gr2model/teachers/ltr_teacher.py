"""A learning-to-rank teacher for the `traces` stage: LightGBM lambdarank on rich features.

`ExpertTeacher`'s linear softmax over its 10 `teacher_features` barely beats the
incoming (pre-ranker) order: a linear model cannot use interactions such as "trust
co-purchase when the pre-ranker is unsure" or "a shared prefix matters only when
no co-purchase exists". `LTRTeacher` keeps the expert for everything that is not
the ranking (its co-purchase statistics with the same cross-fitting folds, its
item side information, its linear evidence weights and its `explain`) and scores
the candidates with a LightGBM ranker (one query = one list of K candidates) on
the 10 expert features plus `EXTRA_FEATURE_NAMES`:

- optionally (`LTRConfig.score_features`, off: they shift between the cross-fitted
  and the full pre-ranker, see SCORE_FEATURE_NAMES) more of the pre-ranker's list:
  raw position, score gaps to the previous / next candidate, softmax probability,
  z-score, the list's entropy and top gap;
- co-purchase with the WHOLE history (recency weighted), with the last item
  (count, P(c | last), P(last | c), lift over popularity), its rank in the list;
- two-hop transitions last -> x -> c (and from the recent items);
- semantic-id prefix and attribute overlap with the whole history;
- popularity rank and relative popularity within the list; history length.

Cross-fitting: a training list with a `fold` is featurised with the counts
without that fold's users (`ExpertTeacher` decides which statistics a fold
gets), as the pre-ranker of that list saw; otherwise the features of training
lists contain the target's own transition and the ranker learns to trust
co-purchase far more than it deserves on validation and test.

Count features of a fold's statistics are rescaled to the size of the full
statistics (`LTRConfig.rescale_counts`): training lists see about (F-1)/F of the
sequences, validation and test lists all of them, and a tree's threshold on a raw
count would otherwise shift between fitting and use.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import polars as pl
import scipy.sparse as sp
from tqdm.auto import tqdm

from gr2model.bounds import check
from gr2model.teachers.teacher import FEATURE_NAMES, CoPurchaseStats, ExpertTeacher, ItemSide, lookup_counts

logger = logging.getLogger(__name__)

__all__ = [
    "EXTRA_FEATURE_NAMES", "LTR_FEATURE_NAMES", "PROMPT_FEATURE_NAMES", "SCORE_FEATURE_NAMES",
    "LTRConfig", "LTRTeacher", "evidence_values",
]  # fmt: skip

EXTRA_FEATURE_NAMES: tuple[str, ...] = (
    # the pre-ranker's list (cand_scores are visible at training and test time)
    "position",  # incoming position 0..K-1 (raw, prerank_rank is its log)
    "score_gap_prev",  # s[i-1] - s[i] (0 for the first)
    "score_gap_next",  # s[i] - s[i+1] (0 for the last)
    "score_prob",  # softmax(s)[i]: the pre-ranker's confidence in i
    "score_z",  # (s[i] - mean) / std within the list
    "list_entropy",  # entropy of softmax(s) (list-level: how unsure the pre-ranker is)
    "list_top_gap",  # s[0] - s[1] (list-level)
    # co-purchase, counts rescaled to the full statistics (see the module docstring)
    "co_after_all",  # log(1 + sum_j d^j C[h_j, c]) over the whole history, most recent j=0
    "co_before_all",  # log(1 + sum_j d^j C[c, h_j])
    "co_last",  # log(1 + C[last, c])
    "p_last",  # C[last, c] / n_last: raw P(c | last)
    "p_rev_last",  # C[c, last] / n_c: P(last | c), c is a typical predecessor of last
    "lift_last",  # trans_last - log prior(c): co-purchase beyond popularity
    "trans_last_rel",  # trans_last minus the list's best
    "co_after_rank",  # rank of co_after_all in the list, 0 = strongest (ties share the best rank)
    "two_hop_last",  # log(1e-6 + sum_x P(x | last) P(c | x))
    "two_hop_recent",  # the same from the recent items, decay-weighted
    # side information against the whole history
    "sid_prefix_all",  # longest shared sid prefix with any history item (0..4)
    "sid_l1_frac",  # share of history items with c's first sid code
    "sid_l2_frac",  # share of history items with c's first two sid codes
    "attr_all",  # idf-weighted shared attributes with the whole history's union
    "attr_freq",  # sum over c's attributes of idf * (share of history items having it)
    # popularity and history
    "pop_rank",  # popularity rank in the list, 0 = most popular
    "pop_rel",  # log(1 + pop) minus the list's mean
    "hist_len",  # log(1 + history length) (list-level)
)
LTR_FEATURE_NAMES: tuple[str, ...] = FEATURE_NAMES + EXTRA_FEATURE_NAMES
# Features read off the pre-ranker's scores beyond the expert's two; off by default
# (LTRConfig.score_features): training lists come from the cross-fitted pre-rankers,
# validation and test lists from the one trained on every sequence, which is more
# confident (Beauty: mean top gap 1.97 vs 2.30, entropy 0.97 vs 0.89), so a ranker
# that leans on them learns a calibration that does not hold at use (valid R@1
# 0.344 with them, 0.359 without).
SCORE_FEATURE_NAMES: tuple[str, ...] = (
    "position", "score_gap_prev", "score_gap_next", "score_prob", "score_z", "list_entropy", "list_top_gap",
)  # fmt: skip
# What a student reading only the prompt can compute: the incoming position and the
# overlap of the candidate's semantic id and attributes with the history it is shown.
# Co-purchase counts, popularity and the pre-ranker's scores are not in the prompt;
# a student could only learn them by memorising every item pair, which ~14k traces
# cannot teach. A ranker fitted on these features alone (`features="prompt"`) is the
# ceiling of what distilling the teacher into a prompt reader can gain.
PROMPT_FEATURE_NAMES: tuple[str, ...] = (
    "prerank_rank", "sid_prefix_last", "sid_prefix_recent", "attr_last", "attr_recent", "sid_l1_frac", "sid_l2_frac",
)  # fmt: skip
_E = {name: i for i, name in enumerate(EXTRA_FEATURE_NAMES)}
_B = {name: i for i, name in enumerate(FEATURE_NAMES)}
_ALL = {name: i for i, name in enumerate(LTR_FEATURE_NAMES)}

_METRICS = ("ndcg@1", "ndcg@3", "map@10")


@dataclass(frozen=True)
class LTRConfig:
    """Hyperparameters of the LTR teacher (LightGBM `LGBMRanker`) and its features.

    objective: "lambdarank" or "rank_xendcg" (LightGBM's listwise alternative).
    num_leaves / min_child_samples / reg_lambda: tree size and regularisation;
        min_child_samples counts candidate rows (K per list).
    learning_rate / n_estimators: boosting; n_estimators bounds the trees (<= 2000),
        early stopping usually ends far earlier.
    subsample / colsample_bytree: row (bagging, every iteration) and feature sampling.
    early_stopping_rounds: stop when `eval_metric` on the validation lists has not
        improved for this many trees; the best iteration is kept.
    eval_metric: the validation metric of early stopping ("ndcg@1", "ndcg@3", "map@10").
    features: "all" (LTR_FEATURE_NAMES), "base" (the expert's 10 FEATURE_NAMES) or
        "prompt" (PROMPT_FEATURE_NAMES: what the student's prompt shows, plus
        `prompt_evidence`).
    prompt_evidence: with "prompt", the evidence features the prompt writes too
        (traces.evidence), at full precision rather than in levels.
    score_features: with "all", keep SCORE_FEATURE_NAMES too (see there why not by default).
    long_decay: weight long_decay**j of the j-th most recent item in the
        whole-history co-purchase features.
    max_history: how many last history items the whole-history features read.
    rescale_counts: scale count features of a fold's statistics to the full size.
    seed: LightGBM's seed (bagging, feature sampling); the fit is deterministic.
    """

    objective: Literal["lambdarank", "rank_xendcg"] = "lambdarank"
    num_leaves: int = 15
    learning_rate: float = 0.05
    n_estimators: int = 500
    min_child_samples: int = 200
    reg_lambda: float = 1.0
    subsample: float = 0.8
    colsample_bytree: float = 0.5
    early_stopping_rounds: int = 50
    eval_metric: Literal["ndcg@1", "ndcg@3", "map@10"] = "ndcg@3"
    features: Literal["all", "base", "prompt"] = "all"
    prompt_evidence: tuple[str, ...] = ()
    score_features: bool = False
    long_decay: float = 0.8
    max_history: int = 50
    rescale_counts: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.objective not in ("lambdarank", "rank_xendcg"):
            raise ValueError(f"objective must be 'lambdarank' or 'rank_xendcg', got {self.objective!r}")
        check(self, "num_leaves", ge=2, le=1024)
        check(self, "learning_rate", gt=0, le=1)
        check(self, "n_estimators", ge=1, le=2000)
        check(self, "min_child_samples", ge=1)
        check(self, "reg_lambda", ge=0)
        check(self, "subsample", gt=0, le=1)
        check(self, "colsample_bytree", gt=0, le=1)
        check(self, "early_stopping_rounds", ge=1)
        # LightGBM takes the seed as a C int.
        check(self, "seed", ge=0, le=2**31 - 1)
        if self.eval_metric not in _METRICS:
            raise ValueError(f"eval_metric must be one of {_METRICS}, got {self.eval_metric!r}")
        if self.features not in ("all", "base", "prompt"):
            raise ValueError(f"features must be 'all', 'base' or 'prompt', got {self.features!r}")
        check(self, "long_decay", gt=0, le=1)
        check(self, "max_history", ge=1)
        if unknown := [n for n in self.prompt_evidence if n not in LTR_FEATURE_NAMES]:
            raise ValueError(f"prompt_evidence: unknown features {unknown}")
        object.__setattr__(self, "prompt_evidence", tuple(self.prompt_evidence))  # a list when read back from teacher.json


@dataclass(frozen=True)
class _Transitions:
    """Two-hop transition probabilities of one statistics set.

    p2: (V, V) CSR float32, sorted indices, P2 = P @ P with P[a, b] = C[a, b] / n_a
        (rows without successors stay empty): P2[h, c] = sum_x P(x | h) P(c | x).
        About 10M entries on Beauty (0.5 s, ~85 MB): precomputed once so that a
        list needs one row lookup per history item instead of a sparse product.
    scale: multiplier that brings this set's counts to the size of the full set.
    """

    p2: sp.csr_matrix
    scale: float

    @classmethod
    def from_stats(cls, stats: CoPurchaseStats, full: CoPurchaseStats) -> _Transitions:
        inv = np.divide(1.0, stats.row_totals, out=np.zeros_like(stats.row_totals), where=stats.row_totals > 0)
        p = (sp.diags(inv) @ stats.counts).tocsr()
        p2 = (p @ p).tocsr().astype(np.float32)
        p2.sort_indices()
        total = stats.pop.sum()
        return cls(p2=p2, scale=float(full.pop.sum() / total) if total > 0 else 1.0)


def _within_list_rank(values: np.ndarray) -> np.ndarray:
    """(K,) float64 rank of each value in descending order, 0 = largest; ties share
    the best rank (so 'no evidence at all' is one rank, not an arbitrary order)."""
    ascending = np.sort(values)
    # The rank is the number of strictly larger values.
    return (len(values) - np.searchsorted(ascending, values, side="right")).astype(np.float64)


def _extra_features(
    history: Sequence[int],
    cands: np.ndarray,
    cand_scores: Sequence[float] | None,
    base: np.ndarray,
    stats: CoPurchaseStats,
    trans: _Transitions,
    side: ItemSide,
    cfg: LTRConfig,
    *,
    recent: int,
    decay: float,
) -> np.ndarray:
    """(K, E) float64 EXTRA_FEATURE_NAMES of one list.

    Args:
        history: item ids, oldest first.
        cands: (K,) int64 candidate ids in the incoming order.
        cand_scores: (K,) the pre-ranker's scores, or None (score features are 0).
        base: (K, 10) the expert's features of the same list (reused, not recomputed).
        stats / trans: the list's (fold's) co-purchase statistics and transitions.
        recent / decay: the expert's recent window and decay (two_hop_recent).
    """
    k = len(cands)
    x = np.zeros((k, len(EXTRA_FEATURE_NAMES)), dtype=np.float64)
    if k == 0:
        return x
    x[:, _E["position"]] = np.arange(k)
    if cand_scores is not None:
        s = np.asarray(cand_scores, dtype=np.float64)
        x[1:, _E["score_gap_prev"]] = s[:-1] - s[1:]
        x[:-1, _E["score_gap_next"]] = s[:-1] - s[1:]
        p = np.exp(s - s.max())
        p /= p.sum()
        x[:, _E["score_prob"]] = p
        std = s.std()
        x[:, _E["score_z"]] = (s - s.mean()) / std if std > 1e-12 else 0.0
        x[:, _E["list_entropy"]] = -(p * np.log(p + 1e-300)).sum()
        top = np.sort(s)[::-1]
        x[:, _E["list_top_gap"]] = top[0] - top[1] if k > 1 else 0.0

    hist = [int(h) for h in list(history)[-cfg.max_history :][::-1]]  # most recent first
    scale = trans.scale if cfg.rescale_counts else 1.0
    x[:, _E["hist_len"]] = math.log1p(len(history))
    pop = stats.pop[cands] * scale
    x[:, _E["pop_rank"]] = _within_list_rank(pop)
    logpop = np.log1p(pop)
    x[:, _E["pop_rel"]] = logpop - logpop.mean()
    v = len(stats.pop)
    # The same add-one popularity prior as the expert's trans_last, so lift = log P(c|last) / P(c).
    prior = (stats.pop[cands] + 1.0) / (stats.pop.sum() + (v - 1))
    trans_last = base[:, _B["trans_last"]]
    x[:, _E["lift_last"]] = trans_last - np.log(prior)
    x[:, _E["trans_last_rel"]] = trans_last - trans_last.max()
    if not hist:
        x[:, _E["two_hop_last"]] = x[:, _E["two_hop_recent"]] = math.log(1e-6)
        return x

    # Whole-history co-purchase: one lookup per distinct history item, weights summed over repeats.
    weight: dict[int, float] = {}
    for j, h in enumerate(hist):
        weight[h] = weight.get(h, 0.0) + cfg.long_decay**j
    after = np.zeros(k)
    before = np.zeros(k)
    for h, w in weight.items():
        after += w * lookup_counts(stats.counts, h, cands)
        before += w * lookup_counts(stats.counts_t, h, cands)
    x[:, _E["co_after_all"]] = np.log1p(scale * after)
    x[:, _E["co_before_all"]] = np.log1p(scale * before)
    x[:, _E["co_after_rank"]] = _within_list_rank(after)

    last = hist[0]
    c_last = lookup_counts(stats.counts, last, cands)
    x[:, _E["co_last"]] = np.log1p(scale * c_last)
    n_last = stats.row_totals[last]
    x[:, _E["p_last"]] = c_last / n_last if n_last > 0 else 0.0
    c_rev = lookup_counts(stats.counts_t, last, cands)  # C[c, last]
    n_c = stats.row_totals[cands]
    x[:, _E["p_rev_last"]] = np.divide(c_rev, n_c, out=np.zeros(k), where=n_c > 0)

    # Two hops: P2[h, c] = sum_x P(x | h) P(c | x), c reached through an item bought after h.
    def two_hop(h: int) -> np.ndarray:
        return lookup_counts(trans.p2, h, cands)

    th_last = two_hop(last)
    x[:, _E["two_hop_last"]] = np.log(1e-6 + th_last)
    th = th_last.copy()
    norm = 1.0
    for j, h in enumerate(hist[1:recent], start=1):
        th += decay**j * two_hop(h)
        norm += decay**j
    x[:, _E["two_hop_recent"]] = np.log(1e-6 + th / norm)

    # Side information against the whole history.
    h_arr = np.asarray(hist, dtype=np.int64)
    sid_c = side.sid[cands]
    sid_h = side.sid[h_arr].copy()
    sid_h[sid_h < 0] = -2  # unknown codes never match
    plen = np.cumprod(sid_c[:, None, :] == sid_h[None, :, :], axis=2).sum(axis=2)  # (K, L)
    x[:, _E["sid_prefix_all"]] = plen.max(axis=1)
    x[:, _E["sid_l1_frac"]] = (plen >= 1).mean(axis=1)
    x[:, _E["sid_l2_frac"]] = (plen >= 2).mean(axis=1)
    attr_count = Counter(a for h in hist for a in side.attrs[h])
    n_hist = len(hist)
    for i, c in enumerate(cands.tolist()):
        own = side.attrs[c]
        x[i, _E["attr_all"]] = sum(side.idf.get(a, 0.0) for a in own if a in attr_count)
        x[i, _E["attr_freq"]] = sum(side.idf.get(a, 0.0) * attr_count[a] / n_hist for a in own if a in attr_count)
    return x


def _lists_rows(lists: pl.DataFrame) -> list[tuple[list[int], list[int], list[float] | None, int | None]]:
    """(history, candidates, cand_scores or None, fold or None) of each row."""
    n = lists.height
    scores = lists["cand_scores"].to_list() if "cand_scores" in lists.columns else [None] * n
    folds = lists["fold"].to_list() if "fold" in lists.columns else [None] * n
    return list(zip(lists["history"].to_list(), lists["candidates"].to_list(), scores, folds))


class LTRTeacher:
    """Teacher (implements `gr2model.teachers.teacher.Teacher`) that ranks with LightGBM lambdarank.

    Args:
        expert: the expert teacher whose statistics (with its cross-fitting folds),
            side information and explanations this teacher uses.
        cfg: hyperparameters and feature choices.

    `fit` trains the ranker (and the expert's linear weights, which `explain`
    uses to choose which evidence to name); `score` is the ranker's output.
    """

    def __init__(self, expert: ExpertTeacher, cfg: LTRConfig | None = None) -> None:
        self.expert = expert
        self.cfg = cfg if cfg is not None else LTRConfig()
        self.booster: Any = None  # lightgbm.Booster once fitted
        self.best_iteration: int = 0
        self._trans: dict[int | None, _Transitions] = {}
        self._extra_keep = np.array([n not in SCORE_FEATURE_NAMES for n in EXTRA_FEATURE_NAMES])

    # ----------------------------------------------------------------- features

    @property
    def feature_names(self) -> tuple[str, ...]:
        """Names of the columns of `features`."""
        if self.cfg.features == "base":
            return FEATURE_NAMES
        if self.cfg.features == "prompt":
            return PROMPT_FEATURE_NAMES + tuple(n for n in self.cfg.prompt_evidence if n not in PROMPT_FEATURE_NAMES)
        if self.cfg.score_features:
            return LTR_FEATURE_NAMES
        return FEATURE_NAMES + tuple(n for n in EXTRA_FEATURE_NAMES if n not in SCORE_FEATURE_NAMES)

    def _fold_key(self, fold: int | None) -> int | None:
        # The expert maps a fold to its statistics (all sequences when it has no folds).
        return None if fold is None or not self.expert.stats_without else int(fold)

    def _transitions(self, fold: int | None) -> _Transitions:
        key = self._fold_key(fold)
        if key not in self._trans:  # built once per fold (a sparse product, well under a second)
            self._trans[key] = _Transitions.from_stats(self.expert._stats(key), self.expert.stats_all)
        return self._trans[key]

    def features(
        self,
        history: Sequence[int],
        candidates: Sequence[int],
        cand_scores: Sequence[float] | None,
        *,
        fold: int | None = None,
    ) -> np.ndarray:
        """(K, F) float64 features of one list, columns `feature_names`, with the
        statistics of `fold` (None: every training sequence)."""
        base = self.expert.features(history, candidates, cand_scores, fold=fold)  # validates fold and scores
        if self.cfg.features == "base":
            return base
        key = self._fold_key(fold)
        extra = _extra_features(
            history, np.asarray(candidates, dtype=np.int64), cand_scores, base,
            self.expert._stats(key), self._transitions(key), self.expert.side, self.cfg,
            recent=self.expert.recent, decay=self.expert.decay,
        )  # fmt: skip
        if self.cfg.features == "prompt":
            full = np.concatenate([base, extra], axis=1)
            return full[:, [_ALL[n] for n in self.feature_names]]
        if not self.cfg.score_features:
            extra = extra[:, self._extra_keep]
        return np.concatenate([base, extra], axis=1)

    def list_features(self, lists: pl.DataFrame, *, desc: str | None = "ltr features") -> tuple[np.ndarray, np.ndarray]:
        """Features of every row of `lists` (history, candidates, cand_scores, optional fold).

        Returns:
            (x, group): x (sum of K, F) float64, the rows of each list in order;
            group (n,) int64, each list's K (LightGBM's query sizes).
        """
        rows = tqdm(_lists_rows(lists), desc=desc, disable=desc is None, leave=False)
        out = [self.features(h, c, s, fold=f) for h, c, s, f in rows]
        group = np.array([len(x) for x in out], dtype=np.int64)
        if not out:
            return np.zeros((0, len(self.feature_names))), group
        return np.concatenate(out), group

    # ------------------------------------------------------------------ fitting

    def fit(self, train_lists: pl.DataFrame, valid_lists: pl.DataFrame, *, fit_linear: bool = True) -> dict[str, Any]:
        """Fit the ranker on the training re-ranking examples, early-stopped on validation.

        Both frames keep only their re-ranking examples (target_rank >= 0); in each
        list the target gets label 1 and the other candidates 0. Training lists
        with a `fold` use that fold's statistics. Deterministic: seed, one thread,
        LightGBM's deterministic mode and row-wise histograms.

        Args:
            train_lists / valid_lists: columns history, candidates, cand_scores,
                target_rank (and fold for training lists).
            fit_linear: also fit the expert's linear weights on train_lists (what
                `explain` uses to choose the evidence it names).
        Returns:
            n_train, n_valid (lists), best_iteration, valid_<metric> at the best
            iteration, feature_s and fit_s (seconds), importance {feature: gain}.
        """
        import lightgbm as lgb  # imported here: only the LTR teacher needs it

        if fit_linear:
            self.expert.fit_weights(train_lists)
        tr = train_lists.filter(pl.col("target_rank") >= 0)
        va = valid_lists.filter(pl.col("target_rank") >= 0)
        if tr.height == 0:
            raise ValueError("no training re-ranking example (target_rank >= 0) to fit on")
        if va.height == 0:
            # Tiny (smoke) data: nothing to stop on; all n_estimators trees are kept.
            logger.warning("LTRTeacher.fit: no validation re-ranking example; no early stopping")
        t0 = time.perf_counter()
        x_tr, g_tr = self.list_features(tr, desc="ltr features (train)")
        x_va, g_va = self.list_features(va, desc="ltr features (valid)")
        feature_s = time.perf_counter() - t0
        y_tr = _labels(g_tr, tr["target_rank"].to_numpy())
        y_va = _labels(g_va, va["target_rank"].to_numpy())
        cfg = self.cfg
        metric, at = cfg.eval_metric.split("@")
        evals: dict[str, Any] = {}
        if va.height:
            evals = {"eval_set": [(x_va, y_va)], "eval_group": [g_va], "eval_at": [int(at)]}

        ranker = lgb.LGBMRanker(
            objective=cfg.objective,
            n_estimators=cfg.n_estimators,
            learning_rate=cfg.learning_rate,
            num_leaves=cfg.num_leaves,
            min_child_samples=cfg.min_child_samples,
            reg_lambda=cfg.reg_lambda,
            subsample=cfg.subsample,
            subsample_freq=1 if cfg.subsample < 1 else 0,
            colsample_bytree=cfg.colsample_bytree,
            random_state=cfg.seed,
            n_jobs=1,  # one thread: deterministic and polite on a shared machine
            deterministic=True,
            force_row_wise=True,
            metric=metric,
            verbose=-1,
        )
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            # lightgbm 4.7 deprecates eval_set for eval_X/eval_y, which 4.5 lacks; we support both.
            warnings.simplefilter("ignore", category=DeprecationWarning)
            warnings.filterwarnings("ignore", message=".*eval_set.*")
            ranker.fit(
                x_tr, y_tr, group=g_tr, feature_name=list(self.feature_names), **evals,
                callbacks=[lgb.early_stopping(cfg.early_stopping_rounds, first_metric_only=True, verbose=False)] if evals else None,
            )  # fmt: skip
        fit_s = time.perf_counter() - t0
        self.booster = ranker.booster_
        self.best_iteration = int(ranker.best_iteration_ or self.booster.current_iteration())
        curve = ranker.evals_result_["valid_0"][cfg.eval_metric] if evals else [float("nan")] * self.best_iteration
        out: dict[str, Any] = {
            "n_train": tr.height,
            "n_valid": va.height,
            "best_iteration": self.best_iteration,
            f"valid_{cfg.eval_metric}": float(curve[self.best_iteration - 1]),
            "feature_s": round(feature_s, 2),
            "fit_s": round(fit_s, 2),
            "importance": self.feature_importance(),
        }
        logger.info(
            "LTRTeacher.fit: %d train / %d valid lists, %d features, best iteration %d (valid %s %.4f), "
            "features %.1fs, fit %.1fs",
            tr.height, va.height, len(self.feature_names), self.best_iteration, cfg.eval_metric,
            out[f"valid_{cfg.eval_metric}"], feature_s, fit_s,
        )  # fmt: skip
        return out

    def feature_importance(self) -> dict[str, float]:
        """{feature: total gain of its splits} up to the best iteration, largest first."""
        self._check_fitted()
        gain = self.booster.feature_importance("gain", iteration=self.best_iteration)
        pairs = sorted(zip(self.feature_names, gain.tolist()), key=lambda kv: -kv[1])
        return {n: round(float(g), 3) for n, g in pairs}

    def model_text(self) -> str:
        """The fitted LightGBM model (best iteration) in LightGBM's text format."""
        self._check_fitted()
        return self.booster.model_to_string(num_iteration=self.best_iteration)

    def load_model_text(self, text: str) -> None:
        """Load a ranker written by `model_text` (the same `cfg.features` choice must be set)."""
        import lightgbm as lgb

        booster = lgb.Booster(model_str=text)
        if booster.num_feature() != len(self.feature_names):
            raise ValueError(
                f"LTR model has {booster.num_feature()} features, this teacher's config gives "
                f"{len(self.feature_names)} ({', '.join(self.feature_names)})"
            )
        self.booster = booster
        self.best_iteration = booster.current_iteration()  # model_text keeps the best iteration only

    def _check_fitted(self) -> None:
        if self.booster is None:
            raise RuntimeError("LTRTeacher is not fitted; call fit() first")

    # ------------------------------------------------------------------ Teacher

    def score(
        self,
        history: Sequence[int],
        candidates: Sequence[int],
        cand_scores: Sequence[float],
        *,
        fold: int | None = None,
    ) -> np.ndarray:
        """(K,) float64 ranker scores (higher = better; used as Plackett-Luce logits)."""
        self._check_fitted()
        x = self.features(history, candidates, cand_scores, fold=fold)
        if len(x) == 0:
            return np.zeros(0, dtype=np.float64)
        return np.asarray(
            self.booster.predict(x, num_iteration=self.best_iteration, num_threads=1), dtype=np.float64
        )

    def explain(
        self,
        history: Sequence[int],
        candidates: Sequence[int],
        ranking: Sequence[int],
        rng: np.random.Generator,
        *,
        cand_scores: Sequence[float] | None = None,
        fold: int | None = None,
        target_tokens: int | None = None,
        cite_positions: bool = False,
        step2: Sequence[str] | None = None,
    ) -> list[str]:
        """The expert's three-step explanation of `ranking` (its evidence, its words; `ExpertTeacher.explain`)."""
        return self.expert.explain(
            history, candidates, ranking, rng, cand_scores=cand_scores, fold=fold, target_tokens=target_tokens,
            cite_positions=cite_positions, step2=step2,
        )


def evidence_values(
    expert: ExpertTeacher, lists: pl.DataFrame, names: Sequence[str], cfg: LTRConfig | None = None, *, desc: str | None = "evidence"
) -> list[np.ndarray]:
    """The values of features `names` (any of LTR_FEATURE_NAMES) for every row of
    `lists`: one (K, F) float64 array per row, F = len(names).

    Training lists with a `fold` get that fold's statistics, as the teacher sees
    them, so a training prompt's evidence never counts its own target. `cfg`
    gives the whole-history settings (long_decay, max_history). Counts are not
    rescaled to the full statistics' size (whatever `cfg.rescale_counts` says):
    a prompt's level must mean the same count on training and test lists, and
    rescaling turns "bought together once" into a different value in each fold
    (on Beauty one count became 0.912, 0.916 and 0.921 in the three folds), which the
    quantile levels then split apart.

    Raises:
        ValueError: a name that is not an LTR feature.
    """
    if unknown := [n for n in names if n not in _ALL]:
        raise ValueError(f"unknown evidence features {unknown}; known: {LTR_FEATURE_NAMES}")
    full = LTRTeacher(expert, replace(cfg or LTRConfig(), features="all", score_features=True, rescale_counts=False))
    cols = [_ALL[n] for n in names]
    rows = tqdm(_lists_rows(lists), desc=desc, disable=desc is None, leave=False)
    return [full.features(h, c, s, fold=f)[:, cols] for h, c, s, f in rows]


def _labels(group: np.ndarray, target_rank: np.ndarray) -> np.ndarray:
    """(sum of group,) int: 1 at each list's target position, 0 elsewhere."""
    y = np.zeros(int(group.sum()), dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(group)[:-1]])
    y[starts + target_rank.astype(np.int64)] = 1
    return y
