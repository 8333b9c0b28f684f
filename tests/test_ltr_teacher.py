"""The LTR teacher: LightGBM lambdarank over the expert's statistics, deterministic, leak-free."""

from __future__ import annotations

import dataclasses

import numpy as np
import polars as pl
import pytest

from gr2model.data.candidates import rerank_metrics
from gr2model.teachers.ltr_teacher import EXTRA_FEATURE_NAMES, LTR_FEATURE_NAMES, PROMPT_FEATURE_NAMES, SCORE_FEATURE_NAMES, LTRConfig, LTRTeacher
from gr2model.teachers.teacher import FEATURE_NAMES, ExpertTeacher, teacher_accuracy
from test_teacher import N_FOLDS, N_ITEMS, toy_items, toy_lists, toy_split  # tests/ is on sys.path (prepend mode)

# Small and fast: a handful of shallow trees is enough for the planted signal.
FAST = LTRConfig(num_leaves=7, n_estimators=60, min_child_samples=10, early_stopping_rounds=20, learning_rate=0.1)


@pytest.fixture(scope="module")
def world():
    items = toy_items()
    split = toy_split(n_users=200)
    train = toy_lists(split, "train", seed=1)
    valid = toy_lists(split, "valid", seed=2)
    expert = ExpertTeacher.from_split(items, split, N_ITEMS, n_folds=N_FOLDS, fold_seed=0)
    teacher = LTRTeacher(expert, FAST)
    info = teacher.fit(train, valid)
    return {"items": items, "split": split, "train": train, "valid": valid, "teacher": teacher, "info": info}


def test_feature_names_and_shapes(world) -> None:
    t = world["teacher"]
    names = t.feature_names
    assert names[: len(FEATURE_NAMES)] == FEATURE_NAMES
    assert not set(SCORE_FEATURE_NAMES) & set(names)  # off by default
    assert set(names) <= set(LTR_FEATURE_NAMES) and len(LTR_FEATURE_NAMES) == len(FEATURE_NAMES) + len(EXTRA_FEATURE_NAMES)
    row = world["valid"].row(0, named=True)
    x = t.features(row["history"], row["candidates"], row["cand_scores"])
    assert x.shape == (len(row["candidates"]), len(names)) and np.isfinite(x).all()
    s = t.score(row["history"], row["candidates"], row["cand_scores"])
    assert s.shape == (len(row["candidates"]),) and s.dtype == np.float64
    # The batch path gives the same rows as the single-list path.
    xb, group = t.list_features(world["valid"].head(3), desc=None)
    assert group.tolist() == [len(c) for c in world["valid"].head(3)["candidates"].to_list()]
    np.testing.assert_allclose(xb[: len(x)], x)
    with_scores = LTRTeacher(t.expert, LTRConfig(score_features=True))
    assert with_scores.features(row["history"], row["candidates"], row["cand_scores"]).shape[1] == len(LTR_FEATURE_NAMES)


def test_fit_learns_the_planted_signal(world) -> None:
    acc = teacher_accuracy(world["teacher"], world["valid"])
    pre = rerank_metrics(world["valid"])
    # The planted next item (succ(last) with probability 0.7) is visible in co-purchase
    # counts; the weak incoming order is beaten by a wide margin.
    assert acc["recall@1"] > pre["recall@1"] + 0.1
    info = world["info"]
    assert 1 <= info["best_iteration"] <= FAST.n_estimators
    assert info["n_train"] == world["train"].height and set(info["importance"]) == set(world["teacher"].feature_names)
    assert "tree" in world["teacher"].model_text().lower()
    # explain keeps working (the expert's linear weights were fitted too).
    row = world["valid"].row(0, named=True)
    ranking = [row["candidates"][i] for i in np.argsort(-world["teacher"].score(row["history"], row["candidates"], row["cand_scores"]))]
    words = world["teacher"].explain(row["history"], row["candidates"], ranking, np.random.default_rng(0), cand_scores=row["cand_scores"])
    assert words[:3] == ["step", "1", ":"]


def test_prompt_features_are_the_prompt_visible_columns(world) -> None:
    """features="prompt" keeps only what the student's prompt shows; the planted signal
    lives in co-purchase counts, which the prompt does not show, so that ranker cannot
    find it (this is the ceiling the traces stage reports as prompt_ceiling)."""
    full = LTRTeacher(world["teacher"].expert, LTRConfig(score_features=True))
    visible = LTRTeacher(world["teacher"].expert, dataclasses.replace(FAST, features="prompt"))
    assert visible.feature_names == PROMPT_FEATURE_NAMES
    assert not {"co_after", "trans_last", "popularity", "prerank_score"} & set(PROMPT_FEATURE_NAMES)
    row = world["valid"].row(0, named=True)
    args = (row["history"], row["candidates"], row["cand_scores"])
    cols = [LTR_FEATURE_NAMES.index(n) for n in PROMPT_FEATURE_NAMES]
    np.testing.assert_array_equal(visible.features(*args), full.features(*args)[:, cols])
    visible.fit(world["train"], world["valid"], fit_linear=False)
    ceiling = teacher_accuracy(visible, world["valid"])["recall@1"]
    assert ceiling < teacher_accuracy(world["teacher"], world["valid"])["recall@1"] - 0.1
    # With the co-purchase evidence written into the prompt, the signal is back in reach.
    told = LTRTeacher(world["teacher"].expert, dataclasses.replace(FAST, features="prompt", prompt_evidence=("co_last",)))
    assert told.feature_names == (*PROMPT_FEATURE_NAMES, "co_last")
    told.fit(world["train"], world["valid"], fit_linear=False)
    assert teacher_accuracy(told, world["valid"])["recall@1"] > ceiling + 0.1


def test_a_prompt_teacher_reads_the_evidence_its_prompt_shows(world) -> None:
    """traces.ltr.features: prompt teaches from what the student sees, and the student sees
    traces.evidence: the teacher's features are the prompt's columns plus that evidence,
    while the other feature sets are left as configured."""
    from tasks.traces import TracesConfig, teacher_ltr_config

    evidence = ["prerank_score", "co_after_all"]
    prompt = TracesConfig(ltr={"features": "prompt"}, evidence=evidence)
    cfg = teacher_ltr_config(prompt)
    assert cfg.prompt_evidence == tuple(evidence)
    assert LTRTeacher(world["teacher"].expert, cfg).feature_names == (*PROMPT_FEATURE_NAMES, *evidence)
    assert teacher_ltr_config(TracesConfig(ltr={"features": "prompt"})).prompt_evidence == ()
    everything = TracesConfig(evidence=evidence)
    assert teacher_ltr_config(everything) == everything.ltr and everything.ltr.prompt_evidence == ()


def test_fit_is_deterministic(world) -> None:
    expert = ExpertTeacher.from_split(world["items"], world["split"], N_ITEMS, n_folds=N_FOLDS, fold_seed=0)
    again = LTRTeacher(expert, FAST)
    again.fit(world["train"], world["valid"])
    assert again.best_iteration == world["teacher"].best_iteration
    for row in world["valid"].head(20).iter_rows(named=True):
        args = (row["history"], row["candidates"], row["cand_scores"])
        np.testing.assert_array_equal(again.score(*args), world["teacher"].score(*args))


def test_one_decisive_feature_is_learnt() -> None:
    """Lists where the target is always the candidate most often bought right after the
    last item, placed at a random incoming position: the ranker must find it."""
    items = toy_items()
    rng = np.random.default_rng(3)
    # Item a is followed by a + 1 (mod N) in every training sequence.
    seqs = [[(s + j) % N_ITEMS + 1 for j in range(5)] for s in range(N_ITEMS)] * 3
    expert = ExpertTeacher(items, seqs, N_ITEMS)

    def lists(n: int) -> pl.DataFrame:
        rows = []
        for _ in range(n):
            last = int(rng.integers(1, N_ITEMS + 1))
            target = last % N_ITEMS + 1
            pool = [i for i in range(1, N_ITEMS + 1) if i not in (last, target)]
            others = [int(c) for c in rng.choice(pool, size=9, replace=False)]
            r = int(rng.integers(10))
            rows.append({"history": [last], "candidates": others[:r] + [target] + others[r:],
                         "cand_scores": list(-0.1 * np.arange(10)), "target_rank": r})  # fmt: skip
        return pl.DataFrame(rows)

    train, valid = lists(300), lists(100)
    teacher = LTRTeacher(expert, FAST)
    teacher.fit(train, valid)
    acc = teacher_accuracy(teacher, valid)
    assert acc["recall@1"] > 0.9 > rerank_metrics(valid)["recall@1"] + 0.5


def test_cross_fitted_features_leave_the_fold_out() -> None:
    """A list whose target transition lives only in fold f: with fold=f the
    co-purchase features see no link to the target, without a fold they do."""
    items = toy_items()
    # Users 0 and 1 hold the only 7 -> 12 transitions; the rest is unrelated.
    seqs = [[7, 12, 30], [7, 12, 40]] + [[20 + i, 40 + i, 21 + i] for i in range(10)]
    folds = [0, 0] + [1 + i % 2 for i in range(10)]
    expert = ExpertTeacher(items, seqs, N_ITEMS, folds=folds)
    teacher = LTRTeacher(expert)
    cands, scores = [12, 17, 50, 3], [0.0, -1.0, -2.0, -3.0]
    names = list(teacher.feature_names)
    leak = ["co_after", "co_after_all", "co_last", "p_last", "lift_last", "trans_last"]
    own = teacher.features([5, 7], cands, scores, fold=0)  # the fold holding the transition: left out
    other = teacher.features([5, 7], cands, scores, fold=1)
    everyone = teacher.features([5, 7], cands, scores)
    for f in ["co_after", "co_after_all", "co_last", "p_last"]:
        i = names.index(f)
        assert own[0, i] == 0.0 and everyone[0, i] > 0 and other[0, i] > 0, f
    for f in leak:
        i = names.index(f)
        assert not np.isclose(own[0, i], everyone[0, i]), f
    with pytest.raises(ValueError, match="fold"):
        teacher.features([5, 7], cands, scores, fold=7)


def test_evidence_values_are_the_named_features_with_the_lists_fold() -> None:
    """The prompt's evidence of a cross-fitted training list is computed without
    its fold, exactly as the teacher's features: its own target transition never shows."""
    from gr2model.teachers.ltr_teacher import evidence_values

    items = toy_items()
    seqs = [[7, 12, 30], [7, 12, 40]] + [[20 + i, 40 + i, 21 + i] for i in range(10)]
    folds = [0, 0] + [1 + i % 2 for i in range(10)]
    expert = ExpertTeacher(items, seqs, N_ITEMS, folds=folds)
    schema = {"history": pl.List(pl.Int64), "candidates": pl.List(pl.Int64), "cand_scores": pl.List(pl.Float64), "fold": pl.Int64}
    lists = pl.DataFrame(
        {"history": [[5, 7], [5, 7]], "candidates": [[12, 17, 50, 3]] * 2, "cand_scores": [[0.0, -1.0, -2.0, -3.0]] * 2, "fold": [0, 1]},
        schema=schema,
    )
    names = ["co_after_all", "prerank_score", "score_gap_next"]  # a score feature too: evidence may use any
    values = evidence_values(expert, lists, names, desc=None)
    # Counts as they are (not rescaled by fold): one co-purchase is the same level everywhere.
    full = LTRTeacher(expert, LTRConfig(score_features=True, rescale_counts=False))
    cols = [full.feature_names.index(n) for n in names]
    for row, fold in enumerate([0, 1]):
        want = full.features([5, 7], [12, 17, 50, 3], [0.0, -1.0, -2.0, -3.0], fold=fold)[:, cols]
        assert values[row].shape == (4, 3)
        np.testing.assert_array_equal(values[row], want)
    assert values[0][0, 0] == 0.0 < values[1][0, 0]  # fold 0 holds the only 7 -> 12 transitions
    with pytest.raises(ValueError, match="unknown evidence"):
        evidence_values(expert, lists, ["no_such_feature"], desc=None)


def test_score_before_fit_raises() -> None:
    teacher = LTRTeacher(ExpertTeacher(toy_items(), [[1, 2, 3]], N_ITEMS))
    with pytest.raises(RuntimeError, match="fit"):
        teacher.score([1], [2, 3], [0.0, -1.0])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_leaves", 1),
        ("learning_rate", 0.0),
        ("n_estimators", 0),
        ("n_estimators", 5000),
        ("min_child_samples", 0),
        ("subsample", 1.5),
        ("colsample_bytree", 0.0),
        ("early_stopping_rounds", 0),
        ("eval_metric", "auc"),
        ("objective", "regression"),
        ("features", "some"),
        ("long_decay", 0.0),
        ("reg_lambda", -1.0),
        ("max_history", 0),
    ],
)
def test_config_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        LTRConfig(**{field: value})


def test_fit_without_validation_examples_keeps_every_tree(world) -> None:
    """Smoke data may have no validation list holding its target: no early stopping then."""
    cfg = LTRConfig(num_leaves=7, n_estimators=5, min_child_samples=10)
    teacher = LTRTeacher(world["teacher"].expert, cfg)
    info = teacher.fit(world["train"], world["valid"].with_columns(target_rank=pl.lit(-1, dtype=pl.Int64)), fit_linear=False)
    assert info["n_valid"] == 0 and teacher.best_iteration == 5


def test_saved_model_scores_like_the_fitted_one(world) -> None:
    """What `evaluate` does: an expert without folds plus the saved model text (the statistics of every training sequence)."""
    t = world["teacher"]
    expert = ExpertTeacher(world["items"], world["split"]["train"].to_list(), N_ITEMS)
    expert.set_weights(t.expert.weights, t.expert.evidence_weights)
    loaded = LTRTeacher(expert, FAST)
    loaded.load_model_text(t.model_text())
    assert loaded.best_iteration == t.best_iteration
    for row in world["valid"].head(20).iter_rows(named=True):
        args = (row["history"], row["candidates"], row["cand_scores"])
        np.testing.assert_allclose(loaded.score(*args), t.score(*args))
    with pytest.raises(ValueError, match="features"):
        LTRTeacher(expert, LTRConfig(features="base")).load_model_text(t.model_text())
