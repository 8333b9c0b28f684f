"""The `traces` teacher: a stronger re-ranker that writes GR2's reasoning traces.

GR2 distils reasoning from a teacher in two ways:
- targeted prompting: the teacher knows the target, ranks it first and explains;
- rejection sampling: the teacher samples rankings without knowing the target and
  only those that put the target first are kept (GR2 found this better; our
  default), so every kept trace explains a ranking the teacher really believed in.

The default teacher, `ExpertTeacher`, is an expert system that knows more than the
student reads in its prompt: co-purchase counts of the training interactions,
shared semantic-id prefixes and (idf-weighted) shared attributes between the
recent history and each candidate, popularity, and the pre-ranker's scores. A
linear softmax over the K candidates on these features (`teacher_features`),
fitted on training lists by `ExpertTeacher.fit_weights`, gives its scores; the
explanation is written from the same evidence, in three steps:

    step 1 : the pattern of the recent history (last item, shared prefix, attribute)
    step 2 : how the top candidates of the ranking match it (real matches only)
    step 3 : the first item of the ranking and why (its strongest evidence)

citing items by their semantic-id tokens and attributes by their attribute tokens,
with a closed word list (`TRACE_WORDS`, the tokenizer's trace words). Length is
steered towards `target_tokens` by choosing how many evidence sentences to write,
never by filler.

Cross-fitting: training candidate lists are cross-fitted over user folds
(`gr2model.data.candidates.crossfit_candidate_lists`) so that no list comes from a
pre-ranker that saw its target. The teacher's co-purchase counts must follow the
same rule, or on training lists they contain the very transition to the target
(the user's own sequence), the fitted weights trust co-purchase far more than it
deserves on validation, and traces cite evidence that is the answer itself. Give
the teacher the same folds (`ExpertTeacher.from_split`) and pass each list's
`fold`: it then uses counts without that fold's users, exactly what the pre-ranker
of that list saw; lists without a fold (validation, test) use every sequence.
On Beauty (TransitionScorer lists) the difference decides whether the teacher
helps at all: fitted with leaky counts it reaches R@1 0.63 on the training lists
and 0.27 on validation (incoming order 0.34); cross-fitted, 0.36 and 0.35.

The `Teacher` protocol is what `generate_traces` needs, so another teacher (e.g. a
local Hugging Face model prompted for rankings and explanations) can replace it.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Literal, Protocol, get_args

import numpy as np
import polars as pl
import scipy.optimize
import scipy.sparse as sp
from tqdm.auto import tqdm

from gr2model.bounds import check
from gr2model.data.candidates import user_folds
from gr2model.task.metrics import ranking_metrics
from gr2model.task.rerank_format import (
    SID_LEVELS,
    FormatConfig,
    ItemText,
    attr_token,
    build_prompt,
    evidence_of,
    evidence_token,
    build_response,
    pos_token,
    sid_token,
)

logger = logging.getLogger(__name__)

__all__ = [
    "FEATURE_NAMES",
    "TRACE_WORDS",
    "TRACE_COLUMNS",
    "Teacher",
    "TeacherConfig",
    "ItemSide",
    "CoPurchaseStats",
    "ExpertTeacher",
    "TraceRecord",
    "teacher_features",
    "plackett_luce_sample",
    "answer_order",
    "scan_reasoning",
    "REASONING_STYLES",
    "generate_traces",
    "teacher_accuracy",
    "lookup_counts",
]

# --------------------------------------------------------------------------- features

FEATURE_NAMES: tuple[str, ...] = (
    "prerank_score",  # pre-ranker score minus the list's best (a log-ratio for log-prob scorers)
    "prerank_rank",  # log(1 + incoming position): the pre-ranker's order itself
    "trans_last",  # log P(c | last item), Dirichlet-smoothed co-purchase counts
    "co_after",  # log(1 + sum_j decay^j C[h_j, c]): c bought soon after recent items
    "co_before",  # log(1 + sum_j decay^j C[c, h_j]): c bought soon before recent items
    "sid_prefix_last",  # shared semantic-id prefix length with the last item (0..3)
    "sid_prefix_recent",  # longest shared prefix with any recent item (0..3)
    "attr_last",  # idf-weighted shared attributes with the last item
    "attr_recent",  # idf-weighted shared attributes with the recent items' union
    "popularity",  # log(1 + training count)
)
_F = {name: i for i, name in enumerate(FEATURE_NAMES)}

# Hand-set weights for an unfitted teacher: the pre-ranker's score plus a nudge
# from each kind of evidence. `fit_weights` replaces them.
_DEFAULT_WEIGHTS: dict[str, float] = {
    "prerank_score": 1.0,
    "co_after": 0.5,
    "co_before": 0.3,
    "sid_prefix_recent": 0.3,
    "attr_recent": 0.1,
}

# The pre-ranker's own features; the "evidence model" (see ExpertTeacher) leaves them out.
_PRERANK_FEATURES = ("prerank_score", "prerank_rank")

# Which features speak for which kind of evidence (for "why" and the sentence order).
_EVIDENCE_FEATURES: dict[str, tuple[str, ...]] = {
    "co_after": ("trans_last", "co_after"),
    "co_before": ("co_before",),
    "sid": ("sid_prefix_last", "sid_prefix_recent"),
    "attr": ("attr_last", "attr_recent"),
    "prerank": ("prerank_score", "prerank_rank"),
    "popular": ("popularity",),
}


@dataclass(frozen=True)
class ItemSide:
    """Item side information the teacher matches on; independent of folds.

    sid: (V, 4) int64 semantic-id codes, V = num_items + 1; -1 where unknown.
    attrs: V tuples of attribute ids (empty where unknown).
    idf: dict attribute id -> log(n_items / document frequency).
    """

    sid: np.ndarray
    attrs: tuple[tuple[int, ...], ...]
    idf: dict[int, float]

    @classmethod
    def from_items(cls, items: pl.DataFrame, num_items: int) -> ItemSide:
        """Build from the prepared items table (item_id, sid, attributes)."""
        v = num_items + 1
        sid = np.full((v, 4), -1, dtype=np.int64)
        attrs: list[tuple[int, ...]] = [() for _ in range(v)]
        df: Counter[int] = Counter()
        for item, codes, a in zip(items["item_id"].to_list(), items["sid"].to_list(), items["attributes"].to_list()):
            item = int(item)
            if not 0 < item < v:
                raise ValueError(f"item id {item} outside 1..{num_items}")
            if codes is not None:
                sid[item, : len(codes)] = codes[:4]
            attrs[item] = tuple(dict.fromkeys(int(x) for x in (a or ())))  # dedup, keep order
            df.update(attrs[item])
        n = max(items.height, 1)
        idf = {a: math.log(n / c) for a, c in df.items()}
        return cls(sid=sid, attrs=tuple(attrs), idf=idf)


@dataclass(frozen=True)
class CoPurchaseStats:
    """Co-purchase counts of a set of training sequences.

    counts: (V, V) CSR, sorted indices; C[a, b] = times b came 1..window steps
        after a in one sequence (unweighted, so explanations can say "N times").
    counts_t: (V, V) CSR of C transposed: row b holds C[a, b] for every a.
    row_totals: (V,) float64, n_a = sum_b C[a, b].
    pop: (V,) float64 occurrence counts (entry 0, padding, is 0).
    popular_count: count from which an item is called popular (90th percentile
        of the items seen).
    """

    counts: sp.csr_matrix
    counts_t: sp.csr_matrix
    row_totals: np.ndarray
    pop: np.ndarray
    popular_count: float

    @classmethod
    def from_counts(cls, counts: sp.csr_matrix, pop: np.ndarray) -> CoPurchaseStats:
        counts = counts.tocsr()
        counts.eliminate_zeros()  # fold subtraction leaves explicit zeros
        counts.sort_indices()
        counts_t = counts.T.tocsr()
        counts_t.sort_indices()
        seen = pop[pop > 0]
        popular = float(np.quantile(seen, 0.9)) if seen.size else math.inf
        return cls(
            counts=counts,
            counts_t=counts_t,
            row_totals=np.asarray(counts.sum(axis=1), dtype=np.float64).ravel(),
            pop=pop.astype(np.float64),
            popular_count=max(popular, 2.0),
        )


def _count_matrix(sequences: Sequence[Sequence[int]], v: int, window: int) -> tuple[sp.csr_matrix, np.ndarray]:
    """(C (V, V) CSR float64, pop (V,) float64) of `sequences` (see CoPurchaseStats)."""
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    pop = np.zeros(v, dtype=np.float64)
    for seq in sequences:
        s = np.asarray(seq, dtype=np.int64)
        if s.size and (s.min() < 1 or s.max() >= v):
            raise ValueError(f"item ids must lie in 1..{v - 1}, got {s.min()}..{s.max()}")
        np.add.at(pop, s, 1.0)
        for d in range(1, min(window, len(s) - 1) + 1):
            rows.append(s[:-d])
            cols.append(s[d:])
    r = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    c = np.concatenate(cols) if cols else np.zeros(0, dtype=np.int64)
    # COO -> CSR sums duplicate (a, b) pairs: exactly the count.
    mat = sp.coo_matrix((np.ones(len(r)), (r, c)), shape=(v, v)).tocsr()
    mat.sum_duplicates()
    return mat, pop


def lookup_counts(mat: sp.csr_matrix, row: int, cols: np.ndarray) -> np.ndarray:
    """mat[row, cols] as a dense (len(cols),) float64 array, without scipy's slow
    fancy indexing: a binary search in the row's sorted column indices."""
    start, end = mat.indptr[row], mat.indptr[row + 1]
    out = np.zeros(len(cols), dtype=np.float64)
    if start == end:
        return out
    idx = mat.indices[start:end]
    pos = np.searchsorted(idx, cols)
    pos_c = np.minimum(pos, end - start - 1)
    hit = idx[pos_c] == cols
    out[hit] = mat.data[start:end][pos_c[hit]]
    return out


@dataclass
class _Analysis:
    """Everything the teacher knows about one list: features and the evidence behind them.

    features: (K, F) float64.
    recent: recent history items, most recent first.
    after_src / after_cnt: (K,) the recent item most often followed by each
        candidate (-1 if none) and that count; before_*: the same, candidate first.
    prefix_src / prefix_len: (K,) the recent item sharing the longest sid prefix
        with each candidate (most recent on ties) and the prefix length.
    shared_attrs: K tuples of attributes shared with recent items, rarest first.
    popular: (K,) bool.
    """

    features: np.ndarray
    recent: list[int]
    after_src: np.ndarray
    after_cnt: np.ndarray
    before_src: np.ndarray
    before_cnt: np.ndarray
    prefix_src: np.ndarray
    prefix_len: np.ndarray
    shared_attrs: list[tuple[int, ...]]
    popular: np.ndarray


def _analyse(
    history: Sequence[int],
    candidates: Sequence[int],
    cand_scores: Sequence[float] | None,
    stats: CoPurchaseStats,
    side: ItemSide,
    *,
    recent: int,
    decay: float,
    smoothing: float,
) -> _Analysis:
    cands = np.asarray(candidates, dtype=np.int64)
    k = len(cands)
    x = np.zeros((k, len(FEATURE_NAMES)), dtype=np.float64)
    rec = [int(h) for h in list(history)[-recent:][::-1]] if recent > 0 else []  # most recent first
    if k == 0:
        empty = np.zeros(0, dtype=np.int64)
        return _Analysis(x, rec, empty, empty, empty, empty, empty, empty, [], np.zeros(0, dtype=bool))

    if cand_scores is not None:
        s = np.asarray(cand_scores, dtype=np.float64)
        if s.shape != (k,):
            raise ValueError(f"cand_scores has shape {s.shape}, expected ({k},)")
        x[:, _F["prerank_score"]] = s - s.max()
    x[:, _F["prerank_rank"]] = np.log1p(np.arange(k))

    after_w = np.zeros(k)
    before_w = np.zeros(k)
    after_cnt = np.zeros(k)
    before_cnt = np.zeros(k)
    after_src = np.full(k, -1, dtype=np.int64)
    before_src = np.full(k, -1, dtype=np.int64)
    c_last = np.zeros(k)
    for j, h in enumerate(rec):
        a = lookup_counts(stats.counts, h, cands)  # C[h, c]
        b = lookup_counts(stats.counts_t, h, cands)  # C[c, h]
        if j == 0:
            c_last = a
        after_w += decay**j * a
        before_w += decay**j * b
        # Strict ">" keeps the most recent source on ties: the one a reader checks first.
        better = a > after_cnt
        after_cnt[better], after_src[better] = a[better], h
        better = b > before_cnt
        before_cnt[better], before_src[better] = b[better], h
    x[:, _F["co_after"]] = np.log1p(after_w)
    x[:, _F["co_before"]] = np.log1p(before_w)

    # Dirichlet-smoothed P(c | last) around the add-one popularity prior, so an item
    # with few observed successors leans on popularity (as the TransitionScorer does).
    v = len(stats.pop)
    prior = (stats.pop[cands] + 1.0) / (stats.pop.sum() + (v - 1))
    if rec:
        x[:, _F["trans_last"]] = np.log((c_last + smoothing * prior) / (stats.row_totals[rec[0]] + smoothing))
    else:
        x[:, _F["trans_last"]] = np.log(prior)

    prefix_len = np.zeros(k, dtype=np.int64)
    prefix_src = np.full(k, -1, dtype=np.int64)
    if rec:
        sid_c = side.sid[cands]
        sid_h = side.sid[np.asarray(rec, dtype=np.int64)].copy()
        sid_h[sid_h < 0] = -2  # unknown codes never match (an unknown candidate code is -1)
        eq = sid_c[:, None, :] == sid_h[None, :, :]  # (K, R, 4)
        plen = np.cumprod(eq, axis=2).sum(axis=2)  # (K, R) shared prefix lengths
        x[:, _F["sid_prefix_last"]] = plen[:, 0]
        best = plen.argmax(axis=1)  # first max = most recent
        prefix_len = plen[np.arange(k), best]
        prefix_src = np.where(prefix_len > 0, np.asarray(rec)[best], -1)
        x[:, _F["sid_prefix_recent"]] = prefix_len

    shared_attrs: list[tuple[int, ...]] = []
    last_attrs = set(side.attrs[rec[0]]) if rec else set()
    union = set().union(*(side.attrs[h] for h in rec)) if rec else set()
    for i, c in enumerate(cands.tolist()):
        own = side.attrs[c]
        shared = [a for a in own if a in union]
        x[i, _F["attr_recent"]] = sum(side.idf.get(a, 0.0) for a in shared)
        x[i, _F["attr_last"]] = sum(side.idf.get(a, 0.0) for a in own if a in last_attrs)
        shared_attrs.append(tuple(sorted(shared, key=lambda a: (-side.idf.get(a, 0.0), a))))

    pop = stats.pop[cands]
    x[:, _F["popularity"]] = np.log1p(pop)
    return _Analysis(
        features=x,
        recent=rec,
        after_src=after_src,
        after_cnt=after_cnt,
        before_src=before_src,
        before_cnt=before_cnt,
        prefix_src=prefix_src,
        prefix_len=prefix_len,
        shared_attrs=shared_attrs,
        popular=pop >= stats.popular_count,
    )


def teacher_features(
    history: Sequence[int],
    candidates: Sequence[int],
    cand_scores: Sequence[float] | None,
    stats: CoPurchaseStats,
    side: ItemSide,
    *,
    recent: int = 5,
    decay: float = 0.6,
    smoothing: float = 20.0,
) -> np.ndarray:
    """Per-candidate features of one list, (K, F) float64, columns `FEATURE_NAMES`.

    Args:
        history: item ids, oldest first; the last `recent` are matched against.
        candidates: K distinct item ids in the incoming order (position = pre-rank).
        cand_scores: (K,) pre-ranker scores, or None (prerank_score is then 0).
        stats: co-purchase counts (those of the list's fold, see `ExpertTeacher`).
        side: semantic ids and attributes.
        recent: how many of the last history items count as "recent".
        decay: weight decay**j of the j-th most recent item in co_after / co_before.
        smoothing: Dirichlet pseudo-count of trans_last.
    """
    return _analyse(
        history, candidates, cand_scores, stats, side, recent=recent, decay=decay, smoothing=smoothing
    ).features


# ------------------------------------------------------------------------- templates

# Every sentence is a template of space-separated tokens; a token in braces is
# replaced by item, prefix, attribute or number tokens. TRACE_WORDS is derived
# from these strings, so the vocabulary is closed by construction.
_T_STEP1_LAST = ("the user last bought {h} .", "the latest purchase is {h} .", "most recently the user bought {h} .")
_T_STEP1_PREFIX = ("{n} of the last {m} purchases share {p} .", "recent purchases cluster around {p} ( {n} of {m} ) .")
_T_STEP1_ATTR = ("{n} of the last {m} purchases have {a} .", "attribute {a} recurs in {n} of {m} recent purchases .")
_T_STEP1_VARIED = ("recent purchases share no prefix or attribute .", "the recent history is varied .")
_T_STEP1_EMPTY = ("the user has no history yet .",)
_T_EVIDENCE: dict[str, tuple[str, ...]] = {
    "co_after": ("{c} was bought soon after {h} {count} .", "shoppers who bought {h} bought {c} soon after {count} ."),
    "co_before": ("{c} was bought shortly before {h} {count} .", "shoppers bought {c} shortly before {h} {count} ."),
    "sid": ("{c} shares {p} with {h} bought before .", "{c} and the earlier {h} share {p} ."),
    "attr": ("{c} shares {a} with recent purchases .", "{c} has {a} like the history ."),
    "prerank": ("the retriever ranks {c} at {n} .", "{c} is number {n} in the incoming list ."),
    "popular": ("{c} is a popular item .", "{c} sells well overall ."),
    "none": ("{c} has no clear link to the history .", "nothing links {c} to recent purchases ."),
}
_T_REASON: dict[str, tuple[str, ...]] = {
    "co_after": ("it is bought soon after {h}", "buyers of {h} pick it next"),
    "co_before": ("it is often bought with {h}", "it goes together with {h}"),
    "sid": ("it shares {p} with {h}", "it is close to {h} ( {p} )"),
    "attr": ("it has {a} like the history", "it matches {a} in the history"),
    "prerank": ("the retriever ranks it at {n}", "the retriever puts it at {n}"),
    "popular": ("it is popular", "it sells well"),
}
_T_STEP3 = ("{c} goes first because {reason} .", "{c} comes first since {reason} .")
_T_STEP3_WEAK = ("{c} goes first , though the evidence for it is weak .",)
_T_THEN = ("then {c} .", "{c} comes next .")
# One step of the scan reasoning: a candidate's evidence, then the best candidate so far with its evidence.
_T_SCAN = ("{c} {e} pick {b} {f} .",)
_STEP_WORDS = ("step", "1", "2", "3", ":")
_MAX_NUMBER = 50  # numbers up to this are written as digits; larger ones as "over 50"
_COUNT_WORDS = ("once", "twice", "times", "over")

_ALL_TEMPLATES: tuple[str, ...] = (
    *_T_STEP1_LAST, *_T_STEP1_PREFIX, *_T_STEP1_ATTR, *_T_STEP1_VARIED, *_T_STEP1_EMPTY,
    *(t for ts in _T_EVIDENCE.values() for t in ts),
    *(t for ts in _T_REASON.values() for t in ts),
    *_T_STEP3, *_T_STEP3_WEAK, *_T_THEN, *_T_SCAN,
)  # fmt: skip

TRACE_WORDS: tuple[str, ...] = tuple(
    sorted(
        {w for t in _ALL_TEMPLATES for w in t.split() if not w.startswith("{")}
        | set(_STEP_WORDS)
        | set(_COUNT_WORDS)
        | {str(i) for i in range(_MAX_NUMBER + 1)}
    )
)


def _number(n: int) -> list[str]:
    return [str(n)] if 0 <= n <= _MAX_NUMBER else ["over", str(_MAX_NUMBER)]


def _count(n: float) -> list[str]:
    n = int(round(n))
    if n == 1:
        return ["once"]
    if n == 2:
        return ["twice"]
    return [*_number(n), "times"]


def _render(template: str, slots: Mapping[str, list[str]]) -> list[str]:
    out: list[str] = []
    for tok in template.split():
        out += slots[tok[1:-1]] if tok.startswith("{") else [tok]
    return out


def _pick(templates: Sequence[str], rng: np.random.Generator) -> str:
    return templates[int(rng.integers(len(templates)))] if len(templates) > 1 else templates[0]


# --------------------------------------------------------------------------- teacher


class Teacher(Protocol):
    """A re-ranking teacher: scores candidates and explains a ranking.

    `fold` is the list's cross-fitting fold (the `fold` column of training lists,
    None for validation/test lists); a teacher with corpus statistics must leave
    that fold's users out, one without them ignores it.
    """

    def score(
        self,
        history: Sequence[int],
        candidates: Sequence[int],
        cand_scores: Sequence[float],
        *,
        fold: int | None = None,
    ) -> np.ndarray:
        """(K,) float64 scores of the candidates, higher = better; no target knowledge."""
        ...

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
        """Explanation tokens (words of TRACE_WORDS, sid, attribute and, with
        cite_positions, position tokens) for `ranking` (a permutation of
        candidates), about target_tokens long; `step2`, when given, is written as
        step 2 in place of the teacher's own (e.g. `scan_reasoning`)."""
        ...


TraceMode = Literal["rejection", "targeted", "distill"]
TRACE_MODES: tuple[str, ...] = get_args(TraceMode)
ReasoningStyle = Literal["evidence", "scan"]
REASONING_STYLES: tuple[str, ...] = get_args(ReasoningStyle)


@dataclass(frozen=True)
class TeacherConfig:
    """How traces are generated.

    mode: "rejection" (sample rankings, keep one whose first item is the target),
        "targeted" (the teacher's ranking with the target moved first) or
        "distill" (the teacher's own ranking, the argsort of its scores, without
        the target: sequence-level distillation; every example gets a trace).
        The target is a noisy label (the best ranker here finds it first in
        about a third of the lists), while the teacher's choice is a
        deterministic function of the evidence the prompt shows: a small
        student learns to imitate the function and only the prior from the
        noisy label (measured: README "Measured here").
    samples: rejection: rankings sampled per example at most.
    temperature: rejection: Plackett-Luce temperature on the teacher's scores.
    target_tokens: explanation length to aim for (whitespace tokens).
    seed: base seed; each example draws from its own (seed, user_id, position)
        stream, so a trace does not depend on which other examples are generated.
    reasoning: what step 2 of the explanation writes. "evidence": the teacher's
        evidence sentences about its top candidates, in its ranking's order (the
        first candidate cited is the decision, taken before any of the
        reasoning). "scan": `scan_reasoning`, every candidate's evidence and the
        best so far, so the decision is worked out in the reasoning and the
        answer's first item is its last pick. The scan needs mode "distill" (the
        pick is the teacher's argmax) and evidence in the prompt.
    ranked_positions: how many leading positions of the answer follow the kept
        ranking (the teacher's order in distill, the sample in rejection); the
        other candidates follow in the incoming order. 0: the whole ranking.
        1 makes the answer one decision (which item to promote) plus a copy;
        3 lets NDCG@3 move while the tail, where the teacher has little to say
        and a rejection sample at temperature 1 is close to random, stays the
        pre-ranker's.
    """

    mode: TraceMode = "rejection"
    samples: int = 8
    temperature: float = 1.0
    target_tokens: int = 130
    seed: int = 0
    ranked_positions: int = 0
    reasoning: ReasoningStyle = "evidence"

    def __post_init__(self) -> None:
        if self.mode not in TRACE_MODES:
            raise ValueError(f"mode must be one of {TRACE_MODES}, got {self.mode!r}")
        if self.reasoning not in REASONING_STYLES:
            raise ValueError(f"reasoning must be one of {REASONING_STYLES}, got {self.reasoning!r}")
        if self.reasoning == "scan" and self.mode != "distill":
            raise ValueError(f"reasoning 'scan' picks the teacher's argmax, so it needs mode 'distill', not {self.mode!r}")
        check(self, "samples", ge=1)
        check(self, "temperature", gt=0)
        check(self, "target_tokens", ge=1)
        check(self, "seed", ge=0)
        check(self, "ranked_positions", ge=0)


def _fit_conditional_logit(z: np.ndarray, y: np.ndarray, l2: float, mask: np.ndarray) -> tuple[np.ndarray, float]:
    """Weights of a softmax over each list's candidates, by L-BFGS from zero.

    Args:
        z: (n, K, F) features; y: (n,) index of the target in each list;
        l2: ridge penalty; mask: (F,) bool, features allowed a weight (others stay 0).
    Returns:
        (F,) weights and the final penalised mean negative log-likelihood.
    """
    n = len(y)
    rows = np.arange(n)
    zm = z[:, :, mask]

    def loss_grad(w: np.ndarray) -> tuple[float, np.ndarray]:
        logits = zm @ w  # (n, K)
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        nll = -np.log(p[rows, y] + 1e-300).mean()
        p[rows, y] -= 1.0  # d nll / d logits = softmax - onehot
        grad = np.einsum("nk,nkf->f", p, zm) / n
        return float(nll + 0.5 * l2 * w @ w), grad + l2 * w

    res = scipy.optimize.minimize(loss_grad, np.zeros(int(mask.sum())), jac=True, method="L-BFGS-B")
    if not res.success:
        logger.warning("conditional logit fit stopped early: %s", res.message)
    w = np.zeros(z.shape[-1])
    w[mask] = res.x
    return w, float(res.fun)


class ExpertTeacher:
    """Feature-based expert teacher (implements `Teacher`).

    Args:
        items: the prepared items table (item_id, sid, attributes).
        train_sequences: the training part of every user's sequence (oldest first).
        num_items: largest item id.
        target_tokens: default explanation length (about 130 in the paper).
        folds: fold index of each training sequence (as `user_folds` deals them for
            `crossfit_candidate_lists`), or None: then `fold` arguments are ignored
            and every list sees all sequences.
        recent: how many last history items are matched against candidates.
        window: a co-purchase is "b within `window` purchases after a".
        decay: weight of the j-th most recent item in the co-purchase features.
        smoothing: pseudo-count of the trans_last feature.
        weights: feature weights (FEATURE_NAMES); default hand-set until `fit_weights`.

    Two weight vectors: `weights` score the candidates (the ranking); the
    evidence model `evidence_weights` (the same fit without the pre-ranker's
    features) decides which evidence the explanation puts first and names as the
    reason. With the pre-ranker's score in the model, the linear attribution of
    a first place almost always goes to "the retriever ranks it at 1" (about 60%
    of Beauty traces), a reason the student can only learn as "copy the incoming
    order"; but that score is itself a co-purchase model, so the evidence model
    names what is behind it (bought soon after an item of the history, a shared
    prefix, a shared attribute) whenever such evidence really lifts the item, and
    the retriever otherwise.
    """

    def __init__(
        self,
        items: pl.DataFrame,
        train_sequences: Sequence[Sequence[int]],
        num_items: int,
        *,
        target_tokens: int = 130,
        folds: Sequence[int] | None = None,
        recent: int = 5,
        window: int = 3,
        decay: float = 0.6,
        smoothing: float = 20.0,
        weights: Mapping[str, float] | None = None,
    ) -> None:
        if recent < 1 or window < 1:
            raise ValueError("recent and window must be >= 1")
        if target_tokens < 1:
            raise ValueError("target_tokens must be >= 1")
        self.num_items = num_items
        self.target_tokens = target_tokens
        self.recent = recent
        self.window = window
        self.decay = decay
        self.smoothing = smoothing
        self.text = ItemText(items)
        self._warned_no_folds = False
        self.side = ItemSide.from_items(items, num_items)
        v = num_items + 1
        t0 = time.perf_counter()
        if folds is None:
            mat, pop = _count_matrix(train_sequences, v, window)
            self.stats_all = CoPurchaseStats.from_counts(mat, pop)
            self.stats_without: dict[int, CoPurchaseStats] = {}
        else:
            fold_arr = np.asarray(folds, dtype=np.int64)
            if fold_arr.shape != (len(train_sequences),):
                raise ValueError(f"{len(fold_arr)} folds for {len(train_sequences)} sequences")
            per_fold = {
                int(f): _count_matrix([s for s, g in zip(train_sequences, fold_arr) if g == f], v, window)
                for f in np.unique(fold_arr)
            }
            mat = sum((m for m, _ in per_fold.values()), sp.csr_matrix((v, v)))
            pop = sum((p for _, p in per_fold.values()), np.zeros(v))
            self.stats_all = CoPurchaseStats.from_counts(mat, pop)
            self.stats_without = {
                f: CoPurchaseStats.from_counts(mat - m_f, pop - p_f) for f, (m_f, p_f) in per_fold.items()
            }
        logger.info(
            "ExpertTeacher: %d co-purchase pairs (window %d), %d folds, built in %.1fs",
            self.stats_all.counts.nnz, window, len(self.stats_without), time.perf_counter() - t0,
        )
        self.weights: dict[str, float] = {n: 0.0 for n in FEATURE_NAMES}
        self.evidence_weights: dict[str, float] = {n: 0.0 for n in FEATURE_NAMES}
        self.set_weights(weights if weights is not None else _DEFAULT_WEIGHTS)

    @classmethod
    def from_split(
        cls,
        items: pl.DataFrame,
        split: pl.DataFrame,
        num_items: int,
        *,
        n_folds: int = 3,
        fold_seed: int = 0,
        **kwargs: object,
    ) -> ExpertTeacher:
        """A teacher on `split`'s train sequences with the folds that
        `crossfit_candidate_lists(..., n_folds, seed=fold_seed)` uses (n_folds < 2: none)."""
        folds = user_folds(split["user_id"].to_numpy(), n_folds, fold_seed) if n_folds >= 2 else None
        return cls(items, split["train"].to_list(), num_items, folds=folds, **kwargs)  # type: ignore[arg-type]

    # ----------------------------------------------------------------- weights

    def set_weights(self, weights: Mapping[str, float], evidence_weights: Mapping[str, float] | None = None) -> None:
        """Replace the feature weights (names not given are 0). evidence_weights
        None: `weights` without the pre-ranker's features."""
        if evidence_weights is None:
            evidence_weights = {n: w for n, w in weights.items() if n not in _PRERANK_FEATURES}
        unknown = (set(weights) | set(evidence_weights)) - set(FEATURE_NAMES)
        if unknown:
            raise ValueError(f"unknown features {sorted(unknown)}; known: {FEATURE_NAMES}")
        self.weights = {n: float(weights.get(n, 0.0)) for n in FEATURE_NAMES}
        self.evidence_weights = {n: float(evidence_weights.get(n, 0.0)) for n in FEATURE_NAMES}
        self._w = np.array([self.weights[n] for n in FEATURE_NAMES], dtype=np.float64)
        self._w_evidence = np.array([self.evidence_weights[n] for n in FEATURE_NAMES], dtype=np.float64)

    def _stats(self, fold: int | None) -> CoPurchaseStats:
        if fold is None:
            return self.stats_all
        if not self.stats_without:
            if not self._warned_no_folds:
                # Cross-fitted lists scored with every sequence's counts: the leak the folds exist to avoid.
                logger.warning("lists have folds but the teacher was built without them; using all sequences")
                self._warned_no_folds = True
            return self.stats_all
        try:
            return self.stats_without[int(fold)]
        except KeyError:
            raise ValueError(f"fold {fold} unknown; the teacher has folds {sorted(self.stats_without)}") from None

    def _analyse(
        self, history: Sequence[int], candidates: Sequence[int], cand_scores: Sequence[float] | None, fold: int | None
    ) -> _Analysis:
        return _analyse(
            history, candidates, cand_scores, self._stats(fold), self.side,
            recent=self.recent, decay=self.decay, smoothing=self.smoothing,
        )  # fmt: skip

    def features(
        self,
        history: Sequence[int],
        candidates: Sequence[int],
        cand_scores: Sequence[float] | None,
        *,
        fold: int | None = None,
    ) -> np.ndarray:
        """(K, F) float64 `teacher_features` with this teacher's statistics for `fold`."""
        return self._analyse(history, candidates, cand_scores, fold).features

    def list_features(self, lists: pl.DataFrame, *, desc: str | None = "teacher features") -> np.ndarray:
        """(n, K, F) features of every row of `lists` (history, candidates,
        cand_scores, optional fold); all lists must have the same K."""
        rows = tqdm(_rows(lists), desc=desc, disable=desc is None, leave=False)
        out = [self.features(h, c, s, fold=f) for h, c, s, f in rows]
        if not out:
            return np.zeros((0, 0, len(FEATURE_NAMES)))
        return np.stack(out)

    def fit_weights(self, lists: pl.DataFrame, *, l2: float = 1e-3) -> dict[str, float]:
        """Fit the weights as a softmax over each list's K candidates (conditional logit).

        Uses the re-ranking examples (target_rank >= 0) of training lists, each with
        its own fold's statistics. Features are standardised for the fit (so `l2`
        treats them alike) and the weights returned on the raw scale. L-BFGS from
        zero: deterministic. The evidence model (`evidence_weights`) is fitted the
        same way without the pre-ranker's features.

        Args:
            lists: columns history, candidates, cand_scores, target_rank (and fold).
            l2: ridge penalty on the standardised weights (per example).
        Returns:
            {feature name: weight}, also set on the teacher.
        """
        ex = lists.filter(pl.col("target_rank") >= 0)
        if ex.height == 0:
            raise ValueError("no re-ranking example (target_rank >= 0) to fit on")
        t0 = time.perf_counter()
        x = self.list_features(ex, desc="fit_weights features")  # (n, K, F)
        y = ex["target_rank"].to_numpy().astype(np.int64)
        n, k, f = x.shape
        std = x.reshape(-1, f).std(axis=0)
        std[std < 1e-12] = 1.0  # a constant feature cannot be learnt; its weight stays 0
        # No centring needed: a softmax over one list ignores a shift shared by its candidates.
        z = x / std
        w, nll = _fit_conditional_logit(z, y, l2, np.ones(f, dtype=bool))
        evidence = np.array([name not in _PRERANK_FEATURES for name in FEATURE_NAMES])
        w_ev, nll_ev = _fit_conditional_logit(z, y, l2, evidence)
        self.set_weights(dict(zip(FEATURE_NAMES, (w / std).tolist())), dict(zip(FEATURE_NAMES, (w_ev / std).tolist())))
        logger.info(
            "fit_weights: %d lists, nll %.4f (evidence model %.4f, uniform %.4f) in %.1fs; weights %s",
            n, nll, nll_ev, math.log(k), time.perf_counter() - t0, {k_: round(v, 3) for k_, v in self.weights.items()},
        )  # fmt: skip
        return dict(self.weights)

    # ------------------------------------------------------------------ Teacher

    def score(
        self,
        history: Sequence[int],
        candidates: Sequence[int],
        cand_scores: Sequence[float],
        *,
        fold: int | None = None,
    ) -> np.ndarray:
        """(K,) float64: features @ weights (softmax logits once fitted)."""
        return self.features(history, candidates, cand_scores, fold=fold) @ self._w

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
        """Three-step explanation of `ranking` (see the module docstring).

        step2: tokens written as step 2 in place of the evidence sentences (e.g.
        `scan_reasoning`); steps 1 and 3 stay the teacher's.

        cite_positions: every candidate is cited as its incoming position token
        followed by its semantic id (`<pos_3> <a_1> <b_2> <c_3> <d_4>`), the form
        the index answer writes: the reasoning then names, in one copyable token,
        the candidates it weighs in the order it ranks them, so the ranking
        follows from it. History items keep their semantic id alone.

        Step 2 states only real evidence (co-purchase counts, shared prefixes,
        shared attributes, incoming position, popularity, or the lack of any link)
        about the ranking's top candidates first; sentences are added in priority
        order while they bring the length closer to target_tokens.

        Raises:
            ValueError: ranking is not a permutation of candidates.
            KeyError: a cited item without a semantic id.
        """
        cands = [int(c) for c in candidates]
        order = [int(r) for r in ranking]
        if sorted(order) != sorted(cands) or len(set(cands)) != len(cands):
            raise ValueError("ranking must be a permutation of distinct candidates")
        target = self.target_tokens if target_tokens is None else target_tokens
        an = self._analyse(history, cands, cand_scores, fold)
        idx_of = {c: i for i, c in enumerate(cands)}
        sid = self.text.sid_tokens

        def cite(c: int) -> list[str]:
            return [pos_token(idx_of[c] + 1), *sid(c)] if cite_positions else sid(c)
        x = an.features
        centred = x - x.mean(axis=0, keepdims=True) if len(cands) else x
        # (K, F): how much each feature lifts each candidate above the list's average,
        # under the scoring model (for the retriever's share) and the evidence model.
        lift_score = centred * self._w
        lift_evidence = centred * self._w_evidence

        def lift(i: int, kind: str) -> float:
            table = lift_score if kind == "prerank" else lift_evidence
            return float(sum(table[i, _F[f]] for f in _EVIDENCE_FEATURES[kind]))

        def slots(i: int, kind: str) -> dict[str, list[str]]:
            c = cands[i]
            if kind == "co_after":
                return {"c": cite(c), "h": sid(int(an.after_src[i])), "count": _count(an.after_cnt[i])}
            if kind == "co_before":
                return {"c": cite(c), "h": sid(int(an.before_src[i])), "count": _count(an.before_cnt[i])}
            if kind == "sid":
                return {"c": cite(c), "h": sid(int(an.prefix_src[i])), "p": sid(c)[: int(an.prefix_len[i])]}
            if kind == "attr":
                return {"c": cite(c), "a": [attr_token(a) for a in an.shared_attrs[i][:2]]}
            if kind == "prerank":
                return {"c": cite(c), "n": _number(i + 1)}
            return {"c": cite(c)}

        def kinds(i: int) -> list[str]:
            """Evidence present for candidate i: what lifts it (strongest first), then
            its incoming position, then present evidence that does not lift it."""
            present = {
                "co_after": an.after_cnt[i] > 0,
                "co_before": an.before_cnt[i] > 0,
                "sid": an.prefix_len[i] > 0,
                "attr": bool(an.shared_attrs[i]),
                "popular": bool(an.popular[i]),
            }
            found = [k for k, yes in present.items() if yes]
            strong = sorted((k for k in found if lift(i, k) > 0), key=lambda k: -lift(i, k))  # stable on ties
            ordered = strong + ["prerank"] + [k for k in found if k not in strong]
            if not any(present[k] for k in ("co_after", "co_before", "sid", "attr")):
                ordered.insert(0, "none")  # the absence of any link is the first thing to say
            return ordered

        # Step 1: the pattern of the recent history.
        step1 = ["step", "1", ":"]
        if not an.recent:
            step1 += _render(_pick(_T_STEP1_EMPTY, rng), {})
        else:
            step1 += _render(_pick(_T_STEP1_LAST, rng), {"h": sid(an.recent[0])})
            pattern = self._history_pattern(an.recent)
            m = _number(len(an.recent))
            if pattern["prefix"] is not None:
                p, n = pattern["prefix"]
                step1 += _render(_pick(_T_STEP1_PREFIX, rng), {"p": p, "n": _number(n), "m": m})
            if pattern["attr"] is not None:
                a, n = pattern["attr"]
                step1 += _render(_pick(_T_STEP1_ATTR, rng), {"a": [a], "n": _number(n), "m": m})
            if pattern["prefix"] is None and pattern["attr"] is None:
                step1 += _render(_pick(_T_STEP1_VARIED, rng), {})

        # Step 3: the chosen first item and its strongest real evidence.
        step3 = ["step", "3", ":"]
        if order:
            first = idx_of[order[0]]
            best = next(k for k in kinds(first) if k != "none")  # lifting evidence, else "prerank"
            if lift(first, best) > 0 or len(cands) == 1:
                reason = _render(_pick(_T_REASON[best], rng), slots(first, best))
                step3 += _render(_pick(_T_STEP3, rng), {"c": cite(order[0]), "reason": reason})
            else:
                # Nothing lifts it above the others: say so rather than invent a reason.
                step3 += _render(_pick(_T_STEP3_WEAK, rng), {"c": cite(order[0])})
            if len(order) > 1:
                step3 += _render(_pick(_T_THEN, rng), {"c": cite(order[1])})

        if step2 is not None:
            return step1 + ["step", "2", ":", *step2] + step3
        # Step 2: evidence sentences, in priority order, while they bring the length closer.
        sentences: dict[tuple[int, int], list[str]] = {}
        evidence = [kinds(idx_of[c]) for c in order]
        top = min(3, len(order))
        priority = [(r, 0) for r in range(top)]
        priority += [(r, j) for r in range(top) for j in range(1, len(evidence[r]))]
        priority += [(r, 0) for r in range(top, len(order))]
        priority += [(r, j) for r in range(top, len(order)) for j in range(1, len(evidence[r]))]
        budget = target - len(step1) - len(step3) - 3  # 3 = "step 2 :"
        used = 0
        chosen: list[tuple[int, int]] = []
        for r, j in priority:
            kind = evidence[r][j]
            toks = _render(_pick(_T_EVIDENCE[kind], rng), slots(idx_of[order[r]], kind))
            # Add a sentence only if the total gets closer to the target.
            if used + len(toks) / 2 < budget:
                sentences[(r, j)] = toks
                chosen.append((r, j))
                used += len(toks)
        step2 = ["step", "2", ":"]
        for key in sorted(chosen):  # read in ranking order, strongest evidence first
            step2 += sentences[key]
        return step1 + step2 + step3

    def _history_pattern(self, recent: list[int]) -> dict[str, tuple | None]:
        """The longest semantic-id prefix and the most telling attribute that at least
        two recent items share: {"prefix": (tokens, count) | None, "attr": (token, count) | None}."""
        out: dict[str, tuple | None] = {"prefix": None, "attr": None}
        if len(recent) < 2:
            return out
        with_sid = [h for h in recent if h in self.text]
        for length in (3, 2, 1):
            counts = Counter(tuple(self.side.sid[h, :length].tolist()) for h in with_sid)
            if counts:
                # max() keeps the first of equal counts: Counter keeps insertion order, most recent first.
                prefix, n = max(counts.items(), key=lambda kv: kv[1])
                if n >= 2:
                    out["prefix"] = ([sid_token(lvl, c) for lvl, c in zip(SID_LEVELS, prefix)], n)
                    break
        attr_counts = Counter(a for h in recent for a in self.side.attrs[h])
        shared = [(a, n) for a, n in attr_counts.items() if n >= 2]
        if shared:
            # Frequent and rare at once: a brand seen 3 times says more than "beauty" seen 5 times.
            a, n = max(shared, key=lambda an_: (an_[1] * self.side.idf.get(an_[0], 0.0), -an_[0]))
            out["attr"] = (attr_token(a), n)
        return out


# ---------------------------------------------------------------------- generation


@dataclass
class TraceRecord:
    """One re-ranking example's trace. response is "" and ranking [] when the
    teacher produced no trace (rejection sampling found no ranking with the target first)."""

    user_id: int
    position: int
    prompt: str
    response: str
    ranking: list[int]
    target: int
    kept: bool
    samples_tried: int
    # The teacher's scores of the K candidates in the incoming order (the soft target of the
    # first decision, `gr2model.training.sft`'s decision_weight).
    teacher_scores: list[float]


TRACE_COLUMNS: dict[str, pl.DataType] = {
    "user_id": pl.Int64,
    "position": pl.Int64,
    "prompt": pl.String,
    "response": pl.String,
    "ranking": pl.List(pl.Int64),
    "target": pl.Int64,
    "kept": pl.Boolean,
    "samples_tried": pl.Int64,
    "teacher_scores": pl.List(pl.Float64),
}


def plackett_luce_sample(scores: np.ndarray, temperature: float, rng: np.random.Generator) -> np.ndarray:
    """One Plackett-Luce ranking of K items with logits scores / temperature.

    Gumbel-max trick: sorting score / T + Gumbel noise is an exact PL draw.

    Args:
        scores: (K,) float.
    Returns:
        (K,) int64 indices into scores, best first.
    """
    s = np.asarray(scores, dtype=np.float64) / temperature
    return np.argsort(-(s + rng.gumbel(size=s.shape)), kind="stable")


def scan_reasoning(evidence: Sequence[Sequence[int]], scores: Sequence[float]) -> list[str]:
    """The scan: every candidate in the incoming order, its evidence levels, then the
    best candidate so far (by `scores`) with its levels.

    `<pos_1> <ev1_7> <ev2_7> ... pick <pos_1> <ev1_7> <ev2_7> ... . <pos_2> ... pick <pos_1> ... .`

    Why: the decision is an argmax over K candidates of a score the student must
    learn from their evidence tokens. Written this way, each step asks one
    comparison between two groups of evidence that sit side by side (the
    candidate just read and the best so far, restated), so a small model learns
    the score pairwise, with K - 1 supervised comparisons per list instead of one
    answer token, and the answer's first item is the last step's pick.
    Ties keep the earlier candidate, as a stable argsort of the scores does.

    Args:
        evidence: (K, F) levels of the prompt's evidence features, incoming order.
        scores: (K,) the teacher's scores, higher = better.
    Raises:
        ValueError: evidence and scores of different lengths, or no evidence features.
    """
    if len(evidence) != len(scores):
        raise ValueError(f"{len(evidence)} candidates' evidence for {len(scores)} scores")
    if len(evidence) and not len(evidence[0]):
        raise ValueError("the scan needs evidence features in the prompt (traces.evidence)")

    def levels(i: int) -> list[str]:
        return [evidence_token(f + 1, int(level)) for f, level in enumerate(evidence[i])]

    out: list[str] = []
    best = 0
    for i in range(len(evidence)):
        if scores[i] > scores[best]:
            best = i
        slots = {"c": [pos_token(i + 1)], "e": levels(i), "b": [pos_token(best + 1)], "f": levels(best)}
        out += _render(_T_SCAN[0], slots)
    return out


def answer_order(ranking: Sequence[int], incoming: Sequence[int], ranked_positions: int) -> list[int]:
    """The first `ranked_positions` items of `ranking`, then the other candidates in the incoming order.

    `answer_order([3, 1, 2, 4], [1, 2, 3, 4], 1) == [3, 1, 2, 4]`; 0 keeps `ranking` whole.
    """
    if not ranked_positions:
        return list(ranking)
    head = list(ranking[:ranked_positions])
    chosen = set(head)
    return head + [c for c in incoming if c not in chosen]


def _rows(lists: pl.DataFrame) -> list[tuple[list[int], list[int], list[float] | None, int | None]]:
    """(history, candidates, cand_scores or None, fold or None) of each row."""
    n = lists.height
    scores = lists["cand_scores"].to_list() if "cand_scores" in lists.columns else [None] * n
    folds = lists["fold"].to_list() if "fold" in lists.columns else [None] * n
    return list(zip(lists["history"].to_list(), lists["candidates"].to_list(), scores, folds))


def _example_rng(seed: int, user_id: int, position: int) -> np.random.Generator:
    # One stream per example: traces do not change when other examples are added or dropped.
    return np.random.default_rng([seed, int(user_id) & 0xFFFFFFFF, int(position) & 0xFFFFFFFF])


def generate_traces(
    teacher: Teacher,
    lists: pl.DataFrame,
    items: ItemText,
    fmt: FormatConfig,
    cfg: TeacherConfig,
    unlabelled: bool = False,
) -> tuple[pl.DataFrame, dict[str, float]]:
    """Write the teacher's traces for the re-ranking examples (target_rank >= 0) of `lists`,
    or for every list of `lists` when `unlabelled` (distill only: the teacher's choice
    needs no target, so lists without it among the candidates are more examples of it).

    targeted: the teacher's ranking (argsort of its scores) with the target moved
    to the top. distill: the teacher's ranking as it is (the target unused).
    rejection: up to cfg.samples Plackett-Luce rankings on
    score / temperature; the first whose top item is the target is kept; if none
    is, the example gets no trace (kept False, response "", ranking []).

    Args:
        lists: columns user_id, position, history, candidates, cand_scores,
            target, target_rank and optionally fold (cross-fitted training lists).
        items: item texts for prompts and responses.
        fmt: how prompts are written.
    Returns:
        (traces, stats). traces: one row per re-ranking example, columns
        TRACE_COLUMNS, in `lists` order. stats: n_examples, n_traces, kept_rate,
        mean_samples_tried, explanation_tokens_mean/median and
        response_tokens_mean/median (whitespace tokens, over kept traces), seconds.
    """
    if cfg.reasoning == "scan" and (not fmt.evidence or fmt.answer != "index"):
        raise ValueError(
            f"reasoning 'scan' cites candidates by position with their evidence: it needs answer 'index' and evidence "
            f"in the prompt (answer {fmt.answer!r}, evidence {list(fmt.evidence)})"
        )
    if unlabelled and cfg.mode != "distill":
        raise ValueError(f"unlabelled lists can only be traced in mode 'distill', not {cfg.mode!r}: the other modes need the target")
    ex = lists if unlabelled else lists.filter(pl.col("target_rank") >= 0)
    t0 = time.perf_counter()
    records: list[TraceRecord] = []
    expl_lens: list[int] = []
    resp_lens: list[int] = []
    rows = zip(ex["user_id"].to_list(), ex["position"].to_list(), ex["target"].to_list(), _rows(ex), evidence_of(ex, fmt))
    for user_id, position, target, (history, cands, cand_scores, fold), evidence in tqdm(
        rows, total=ex.height, desc=f"traces ({cfg.mode})", leave=False
    ):
        rng = _example_rng(cfg.seed, user_id, position)
        s = teacher.score(history, cands, cand_scores, fold=fold)
        ranking: list[int] = []
        if cfg.mode in ("targeted", "distill"):
            order = [cands[i] for i in np.argsort(-s, kind="stable")]
            ranking = [target] + [c for c in order if c != target] if cfg.mode == "targeted" else order
            tried = 1
        else:
            tried = 0
            for _ in range(cfg.samples):
                tried += 1
                sample = [cands[i] for i in plackett_luce_sample(s, cfg.temperature, rng)]
                if sample[0] == target:
                    ranking = sample
                    break
        if ranking and cfg.ranked_positions:
            ranking = answer_order(ranking, cands, cfg.ranked_positions)
        prompt = build_prompt(history, cands, items, fmt, evidence)
        response = ""
        if ranking:
            step2 = scan_reasoning(evidence, s) if cfg.reasoning == "scan" else None
            expl = teacher.explain(
                history, cands, ranking, rng, cand_scores=cand_scores, fold=fold, target_tokens=cfg.target_tokens,
                cite_positions=fmt.answer == "index", step2=step2,
            )
            response = build_response(expl, ranking, items, fmt=fmt, candidates=cands)
            expl_lens.append(len(expl))
            resp_lens.append(len(response.split()))
        records.append(TraceRecord(user_id, position, prompt, response, ranking, target, bool(ranking), tried, [float(x) for x in s]))
    traces = pl.DataFrame([asdict(r) for r in records], schema=TRACE_COLUMNS)
    seconds = time.perf_counter() - t0
    n = len(records)
    stats: dict[str, float] = {
        "n_examples": n,
        "n_unlabelled": int((ex["target_rank"] < 0).sum()),
        "n_traces": len(expl_lens),
        "kept_rate": len(expl_lens) / n if n else 0.0,
        "mean_samples_tried": float(np.mean([r.samples_tried for r in records])) if n else 0.0,
        "explanation_tokens_mean": float(np.mean(expl_lens)) if expl_lens else 0.0,
        "explanation_tokens_median": float(np.median(expl_lens)) if expl_lens else 0.0,
        "response_tokens_mean": float(np.mean(resp_lens)) if resp_lens else 0.0,
        "response_tokens_median": float(np.median(resp_lens)) if resp_lens else 0.0,
        "seconds": seconds,
    }
    logger.info(
        "generate_traces (%s): %d examples, %d traces (kept %.3f), explanation %.1f tokens, in %.1fs",
        cfg.mode, n, stats["n_traces"], stats["kept_rate"], stats["explanation_tokens_mean"], seconds,
    )  # fmt: skip
    return traces, stats


def teacher_accuracy(teacher: Teacher, lists: pl.DataFrame) -> dict[str, float]:
    """The teacher's own ranking (argsort of its scores, no target knowledge) on the
    re-ranking examples (target_rank >= 0); ties keep the incoming order.

    Args:
        lists: columns history, candidates, cand_scores, target_rank (and fold).
    Returns:
        recall@1, recall@3, recall@5, ndcg@3, ndcg@5 and n; compare with
        `gr2model.data.candidates.rerank_metrics(lists)` (the incoming order).
    """
    ex = lists.filter(pl.col("target_rank") >= 0)
    target_rank = ex["target_rank"].to_numpy().astype(np.int64)
    ranks = np.empty(ex.height, dtype=np.int64)
    for i, (history, cands, cand_scores, fold) in enumerate(
        tqdm(_rows(ex), desc="teacher accuracy", leave=False)
    ):
        order = np.argsort(-teacher.score(history, cands, cand_scores, fold=fold), kind="stable")
        ranks[i] = int(np.flatnonzero(order == target_rank[i])[0])
    out = ranking_metrics(ranks, (1, 3, 5), (3, 5))
    logger.info("teacher_accuracy: %s", {k: round(v, 4) for k, v in out.items()})
    return out
