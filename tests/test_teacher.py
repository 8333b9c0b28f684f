"""The traces teacher: features, fitting, honest closed-vocabulary explanations, trace generation."""

from __future__ import annotations

import re

import numpy as np
import polars as pl
import pytest

from gr2model.data.candidates import rerank_metrics, user_folds
from gr2model.data.dataset import leave_one_out
from gr2model.task.rerank_format import FormatConfig, ItemText, build_response, parse_response
from gr2model.teachers.teacher import (
    FEATURE_NAMES,
    TRACE_COLUMNS,
    TRACE_WORDS,
    ExpertTeacher,
    TeacherConfig,
    answer_order,
    generate_traces,
    plackett_luce_sample,
    scan_reasoning,
    teacher_accuracy,
)

ID_TOKEN = re.compile(r"<(?:[abcd]|attr)_[0-9]+>")
N_ITEMS = 60
K = 10
N_FOLDS = 3


# ------------------------------------------------------------------- a toy world


def toy_items(n: int = N_ITEMS) -> pl.DataFrame:
    """Items 1..n: sid [i % 5, (i // 5) % 4, i % 3, i] (unique by the d code), attributes
    [1 + i % 6, 10 + i % 4] plus a rare one (20) for every tenth item."""
    ids = list(range(1, n + 1))
    return pl.DataFrame(
        {
            "item_id": ids,
            "sid": [[i % 5, (i // 5) % 4, i % 3, i] for i in ids],
            "attributes": [[1 + i % 6, 10 + i % 4] + ([20] if i % 10 == 0 else []) for i in ids],
        },
        schema={"item_id": pl.Int64, "sid": pl.List(pl.Int64), "attributes": pl.List(pl.Int64)},
    )


def toy_split(n_users: int = 300, seed: int = 0) -> pl.DataFrame:
    """Sequences where the next item is succ(last) with probability 0.7 (a planted
    co-purchase pattern), else a random item; 6..10 items a user."""
    rng = np.random.default_rng(seed)
    succ = rng.permutation(np.arange(1, N_ITEMS + 1))
    rows = []
    for u in range(1, n_users + 1):
        seq = [int(rng.integers(1, N_ITEMS + 1))]
        for _ in range(int(rng.integers(6, 11)) - 1):
            nxt = int(succ[seq[-1] - 1]) if rng.random() < 0.7 else int(rng.integers(1, N_ITEMS + 1))
            seq.append(nxt)
        rows.append((u, seq))
    seqs = pl.DataFrame(rows, schema={"user_id": pl.Int64, "items": pl.List(pl.Int64)}, orient="row")
    return leave_one_out(seqs)


def toy_lists(split: pl.DataFrame, which: str, seed: int) -> pl.DataFrame:
    """K-candidate lists from a weak fake pre-ranker: the target plus K-1 random items
    outside the history, the target placed at position r with P(r) ~ 0.8**r (so the
    incoming order is informative but weak), scores decreasing. `train` lists hold the
    last 3 training positions of each user and their cross-fitting fold."""
    rng = np.random.default_rng(seed)
    folds = dict(zip(split["user_id"].to_list(), user_folds(split["user_id"].to_numpy(), N_FOLDS, 0).tolist()))
    p_rank = 0.8 ** np.arange(K)
    p_rank /= p_rank.sum()
    out = []
    for user, train, valid, _test in split.iter_rows():
        if which == "valid":
            examples = [(len(train), train, valid)]
        else:
            examples = [(t, train[:t], train[t]) for t in range(max(1, len(train) - 3), len(train))]
        for pos, hist, target in examples:
            pool = [i for i in range(1, N_ITEMS + 1) if i not in hist and i != target]
            others = [int(x) for x in rng.choice(pool, size=K - 1, replace=False)]
            r = int(rng.choice(K, p=p_rank))
            cands = others[:r] + [target] + others[r:]
            row = {
                "user_id": user, "position": pos, "history": list(hist), "target": target,
                "candidates": cands, "cand_scores": list(-np.arange(K, dtype=np.float64) * 0.3),
                "target_rank": r,
            }  # fmt: skip
            if which == "train":
                row["fold"] = folds[user]
            out.append(row)
    schema = {
        "user_id": pl.Int64, "position": pl.Int64, "history": pl.List(pl.Int64), "target": pl.Int64,
        "candidates": pl.List(pl.Int64), "cand_scores": pl.List(pl.Float32), "target_rank": pl.Int64,
    }  # fmt: skip
    if which == "train":
        schema["fold"] = pl.Int64
    return pl.DataFrame(out, schema=schema)


@pytest.fixture(scope="module")
def world():
    items = toy_items()
    split = toy_split()
    teacher = ExpertTeacher.from_split(items, split, N_ITEMS, n_folds=N_FOLDS, fold_seed=0)
    train = toy_lists(split, "train", seed=1)
    valid = toy_lists(split, "valid", seed=2)
    weights = teacher.fit_weights(train)
    return {"items": items, "text": ItemText(items), "split": split, "teacher": teacher,
            "train": train, "valid": valid, "weights": weights}  # fmt: skip


@pytest.fixture(scope="module")
def traces(world):
    """{mode: (traces, stats)} of the training lists with the default config (generated once)."""
    return {
        mode: generate_traces(world["teacher"], world["train"], world["text"], FormatConfig(), TeacherConfig(mode=mode))
        for mode in ("rejection", "targeted", "distill")
    }


def explanation_tokens(response: str) -> list[str]:
    body = response.split('"explanation" : "', 1)[1].split('" , "recommendations"', 1)[0]
    return body.split()


# ---------------------------------------------------------------------- features


def test_features_hand_example() -> None:
    items = toy_items()
    # 7 -> 12 three times (within the 3-step window), 12 -> 7 once.
    seqs = [[7, 12, 30], [7, 12, 40], [5, 7, 12], [12, 7]]
    t = ExpertTeacher(items, seqs, N_ITEMS)
    x = t.features([3, 7], [12, 17, 50], [0.0, -1.0, -2.0])
    assert x.shape == (3, len(FEATURE_NAMES))
    f = {n: x[:, i] for i, n in enumerate(FEATURE_NAMES)}
    np.testing.assert_allclose(f["prerank_score"], [0.0, -1.0, -2.0])
    np.testing.assert_allclose(f["prerank_rank"], np.log1p([0, 1, 2]))
    assert f["co_after"][0] == pytest.approx(np.log1p(3.0))  # C[7, 12] = 3
    assert f["co_after"][1] == f["co_after"][2] == 0.0
    assert f["co_before"][0] == pytest.approx(np.log1p(1.0))  # C[12, 7] = 1
    # sids: 7 = [2, 1, 1, 7], 12 = [2, 2, 0, 12], 17 = [2, 3, 2, 17], 3 = [3, 0, 0, 3], 50 = [0, 2, 2, 50].
    np.testing.assert_array_equal(f["sid_prefix_last"], [1, 1, 0])
    # attributes: 7 = [2, 13], 3 = [4, 13], 12 = [1, 10], 17 = [6, 11], 50 = [3, 12, 20].
    assert f["attr_recent"][0] == 0.0 and f["attr_last"][0] == 0.0
    assert f["popularity"][0] == pytest.approx(np.log1p(4.0))  # 12 occurs 4 times
    assert f["trans_last"][0] > f["trans_last"][1]


def test_folds_leave_that_fold_out() -> None:
    items = toy_items()
    split = toy_split(n_users=60)
    teacher = ExpertTeacher.from_split(items, split, N_ITEMS, n_folds=N_FOLDS, fold_seed=0)
    folds = user_folds(split["user_id"].to_numpy(), N_FOLDS, 0)
    trains = split["train"].to_list()
    hist, cands, scores = trains[0][:3], [i for i in range(1, 11) if i not in trains[0][:3]], None
    for f in range(N_FOLDS):
        others = ExpertTeacher(items, [s for s, g in zip(trains, folds) if g != f], N_ITEMS)
        np.testing.assert_allclose(
            teacher.features(hist, cands, scores, fold=f), others.features(hist, cands, scores), atol=1e-9
        )
    everyone = ExpertTeacher(items, trains, N_ITEMS)
    np.testing.assert_allclose(teacher.features(hist, cands, scores), everyone.features(hist, cands, scores))
    with pytest.raises(ValueError, match="fold"):
        teacher.features(hist, cands, scores, fold=7)


def test_fit_weights_beats_random_and_prerank(world) -> None:
    acc = teacher_accuracy(world["teacher"], world["valid"])
    pre = rerank_metrics(world["valid"])
    assert acc["n"] == pre["n"] == world["valid"].height
    assert acc["recall@1"] > 0.1 + 0.15  # random order: 1/K
    assert acc["recall@1"] >= pre["recall@1"]
    assert acc["ndcg@3"] >= pre["ndcg@3"]
    # The planted signal is co-purchase with the last items: it must get a positive weight.
    assert world["weights"]["co_after"] > 0
    # The evidence model (what explanations name) leaves the pre-ranker's features out.
    ev = world["teacher"].evidence_weights
    assert ev["prerank_score"] == ev["prerank_rank"] == 0.0 and ev["co_after"] > 0
    # Deterministic: a second fit gives the same weights.
    again = ExpertTeacher.from_split(world["items"], world["split"], N_ITEMS, n_folds=N_FOLDS)
    assert again.fit_weights(world["train"]) == world["weights"]


# ------------------------------------------------------------------ explanations


def test_trace_words_are_single_clean_tokens() -> None:
    assert len(set(TRACE_WORDS)) == len(TRACE_WORDS)
    assert {"step", "1", "2", "3", ":", ".", "once", "twice", "times", "0", "50"} <= set(TRACE_WORDS)
    assert not any(ID_TOKEN.fullmatch(w) for w in TRACE_WORDS)
    build_response(list(TRACE_WORDS), [], ItemText(toy_items()))  # every word is accepted by the format


def test_explanation_states_real_evidence() -> None:
    items = toy_items()
    text = ItemText(items)
    seqs = [[7, 12, 30], [7, 12, 40], [5, 7, 12], [12, 7]]
    t = ExpertTeacher(items, seqs, N_ITEMS, weights={"co_after": 1.0})
    sid = lambda i: " ".join(text.sid_tokens(i))  # noqa: E731
    seen_after = False
    for seed in range(20):
        expl = t.explain([3, 7], [17, 12, 50], [12, 17, 50], np.random.default_rng(seed), target_tokens=400)
        s = " ".join(expl)
        assert s.startswith("step 1 :") and " step 2 : " in s and " step 3 : " in s
        step3 = s.split(" step 3 : ")[1]
        assert step3.startswith(sid(12))  # names the chosen first item
        assert f"bought soon after {sid(7)}" in step3 or f"buyers of {sid(7)} pick it next" in step3
        # The co-purchase count is the real one (3), in either wording.
        seen_after |= f"{sid(12)} was bought soon after {sid(7)} 3 times" in s
        assert f"shoppers who bought {sid(7)} bought {sid(12)} soon after 3 times" in s or (
            f"{sid(12)} was bought soon after {sid(7)} 3 times" in s
        )
        # 50 has no link to [3, 7] (no co-purchase, prefix or attribute): said so.
        assert f"{sid(50)} has no clear link to the history" in s or f"nothing links {sid(50)} to recent purchases" in s
        # Nothing false: 50 is never said to share or to be bought with anything.
        assert f"{sid(50)} shares" not in s and f"{sid(50)} was bought" not in s
    assert seen_after  # the rng varies the wording


def test_explain_rejects_non_permutation(world) -> None:
    with pytest.raises(ValueError, match="permutation"):
        world["teacher"].explain([1, 2], [3, 4, 5], [3, 4], np.random.default_rng(0))


# ------------------------------------------------------------------- generation


def test_targeted_traces_rank_target_first(world, traces) -> None:
    traces, stats = traces["targeted"]
    assert traces.schema == pl.Schema(TRACE_COLUMNS)
    assert traces.height == stats["n_examples"] == world["train"].height
    assert traces["kept"].all() and stats["kept_rate"] == 1.0
    assert (traces["ranking"].list.first() == traces["target"]).all()


def test_distill_traces_follow_the_teacher_not_the_target(world, traces) -> None:
    traces, stats = traces["distill"]
    lists = world["train"]
    assert traces["kept"].all() and stats["kept_rate"] == 1.0
    # Each ranking is the teacher's own order of the candidates (the target plays no part) ...
    for hist, cands, scores, fold, ranking in zip(
        lists["history"].to_list(), lists["candidates"].to_list(), lists["cand_scores"].to_list(),
        lists["fold"].to_list(), traces["ranking"].to_list(), strict=True,
    ):  # fmt: skip
        s = world["teacher"].score(hist, cands, scores, fold=fold)
        assert ranking == [cands[i] for i in np.argsort(-s, kind="stable")]
    # ... so it puts the target first only where the teacher does, not always.
    first_is_target = (traces["ranking"].list.first() == traces["target"]).mean()
    assert 0.0 < first_is_target < 1.0


def test_distill_traces_unlabelled_lists_get_the_teachers_ranking(world, traces) -> None:
    """A list whose target is not among the candidates is still an example of the
    teacher's choice: distill traces it like a re-ranking example (same ranking, same
    explanation); the modes that need the target refuse it."""
    lists = world["train"].head(40)

    def outside(hist: list[int], cands: list[int]) -> int:  # a next item the pre-ranker missed
        return next(i for i in range(1, N_ITEMS + 1) if i not in cands and i not in hist)

    missed = lists.tail(20).with_columns(
        pl.Series("target", [outside(h, c) for h, c in zip(lists.tail(20)["history"], lists.tail(20)["candidates"])]),
        pl.lit(-1, dtype=pl.Int64).alias("target_rank"),
    )
    mixed = pl.concat([lists.head(20), missed])
    out, stats = generate_traces(world["teacher"], mixed, world["text"], FormatConfig(), TeacherConfig(mode="distill"), unlabelled=True)
    expected = traces["distill"][0].head(40)
    assert out.height == 40 and stats["n_unlabelled"] == 20 and out["kept"].all()
    assert out["ranking"].to_list() == expected["ranking"].to_list()
    assert out["response"].to_list() == expected["response"].to_list()
    assert out["target"].to_list() == mixed["target"].to_list()
    # Without the flag only the re-ranking examples are traced, as before.
    only, stats = generate_traces(world["teacher"], mixed, world["text"], FormatConfig(), TeacherConfig(mode="distill"))
    assert only.height == 20 and stats["n_unlabelled"] == 0
    with pytest.raises(ValueError, match="distill"):
        generate_traces(world["teacher"], mixed, world["text"], FormatConfig(), TeacherConfig(mode="rejection"), unlabelled=True)


def test_rejection_keeps_only_target_first(world, traces) -> None:
    traces, stats = traces["rejection"]  # samples 8, temperature 1
    kept = traces.filter("kept")
    dropped = traces.filter(~pl.col("kept"))
    assert 0.0 < stats["kept_rate"] < 1.0
    assert stats["kept_rate"] == pytest.approx(kept.height / traces.height)
    assert (kept["ranking"].list.first() == kept["target"]).all()
    assert kept["samples_tried"].is_between(1, 8).all()
    # An example without a kept sample tried them all and has no trace.
    assert (dropped["samples_tried"] == 8).all()
    assert (dropped["response"] == "").all() and (dropped["ranking"].list.len() == 0).all()
    # One sample keeps fewer than eight (same examples).
    lists = world["train"].head(300)
    one, _ = generate_traces(world["teacher"], lists, world["text"], FormatConfig(), TeacherConfig(samples=1))
    assert one["kept"].mean() < traces.head(300)["kept"].mean()


@pytest.mark.parametrize("mode", ["rejection", "targeted", "distill"])
def test_responses_parse_and_use_closed_vocabulary(world, traces, mode: str) -> None:
    text, lists = world["text"], world["train"]
    traces, stats = traces[mode]
    cands = {(u, p): c for u, p, c in lists.select("user_id", "position", "candidates").iter_rows()}
    words = set(TRACE_WORDS)
    lengths = []
    for user, pos, prompt, response, ranking, _target, kept, _tried, _scores in traces.filter("kept").iter_rows():
        parsed = parse_response(response, cands[(user, pos)], text)
        assert parsed.valid_permutation, parsed.error
        assert parsed.ranking == ranking
        assert prompt.startswith("<|user|> history :")
        toks = explanation_tokens(response)
        assert parsed.explanation == " ".join(toks)
        unknown = [w for w in toks if w not in words and not ID_TOKEN.fullmatch(w)]
        assert not unknown
        lengths.append(len(toks))
    assert len(lengths) > 100
    assert abs(np.median(lengths) - 130) <= 5
    assert max(abs(n - 130) for n in lengths) <= 15
    assert stats["explanation_tokens_median"] == np.median(lengths)
    assert stats["response_tokens_mean"] > stats["explanation_tokens_mean"]


@pytest.mark.parametrize("target", [60, 200])
def test_length_follows_target_tokens(world, target: int) -> None:
    cfg = TeacherConfig(mode="targeted", target_tokens=target)
    traces, _ = generate_traces(world["teacher"], world["valid"].head(80), world["text"], FormatConfig(), cfg)
    lengths = [len(explanation_tokens(r)) for r in traces["response"]]
    assert abs(np.median(lengths) - target) <= 6
    assert max(abs(n - target) for n in lengths) <= 15


def test_same_seed_same_traces(world) -> None:
    lists = world["train"].head(150)
    run = lambda seed: generate_traces(  # noqa: E731
        world["teacher"], lists, world["text"], FormatConfig(), TeacherConfig(seed=seed)
    )[0]
    a, b, c = run(3), run(3), run(4)
    assert a.equals(b)
    assert not a.equals(c)
    # A trace depends on its own example only, not on which others are generated.
    sub = generate_traces(world["teacher"], lists.tail(50), world["text"], FormatConfig(), TeacherConfig(seed=3))[0]
    assert sub.equals(a.tail(sub.height))


def test_non_reranking_examples_are_skipped(world) -> None:
    lists = world["valid"].head(20).with_columns(
        target_rank=pl.when(pl.int_range(pl.len()) < 5).then(-1).otherwise(pl.col("target_rank"))
    )
    traces, stats = generate_traces(world["teacher"], lists, world["text"], FormatConfig(), TeacherConfig())
    assert traces.height == stats["n_examples"] == 15
    assert teacher_accuracy(world["teacher"], lists)["n"] == 15


# ----------------------------------------------------------------- small pieces


def test_plackett_luce_sample() -> None:
    rng = np.random.default_rng(0)
    scores = np.log(np.array([0.5, 0.3, 0.2]))
    firsts = np.array([plackett_luce_sample(scores, 1.0, rng)[0] for _ in range(4000)])
    np.testing.assert_allclose(np.bincount(firsts, minlength=3) / 4000, [0.5, 0.3, 0.2], atol=0.03)
    perm = plackett_luce_sample(np.zeros(7), 1.0, rng)
    assert sorted(perm.tolist()) == list(range(7))
    # A cold temperature follows the scores.
    assert plackett_luce_sample(np.array([0.0, 1.0, 2.0]), 1e-3, rng).tolist() == [2, 1, 0]


@pytest.mark.parametrize(
    "kwargs", [{"mode": "greedy"}, {"samples": 0}, {"temperature": 0.0}, {"target_tokens": 0}]
)
def test_config_validation(kwargs) -> None:
    with pytest.raises(ValueError):
        TeacherConfig(**kwargs)


def test_unknown_weight_name() -> None:
    with pytest.raises(ValueError, match="unknown features"):
        ExpertTeacher(toy_items(), [[1, 2, 3]], N_ITEMS, weights={"magic": 1.0})


def test_answer_order_keeps_the_ranked_head_then_the_incoming_order() -> None:
    assert answer_order([7, 3, 9, 1], [1, 3, 7, 9], 1) == [7, 1, 3, 9]
    assert answer_order([7, 3, 9, 1], [1, 3, 7, 9], 2) == [7, 3, 1, 9]
    assert answer_order([7, 3, 9, 1], [1, 3, 7, 9], 0) == [7, 3, 9, 1]
    assert answer_order([7, 3, 9, 1], [1, 3, 7, 9], 10) == [7, 3, 9, 1]


def test_reasoning_first_traces_decide_inside_the_reasoning(world) -> None:
    """Index format, reasoning first: the explanation cites candidates as `<pos_k>` + semantic id,
    its first citation is the ranking's first item and its step 3 names the first two in order;
    with ranked_positions 3 the answer follows the teacher's first three, then the incoming order."""
    fmt = FormatConfig(answer="index", answer_first=False)
    lists = world["train"].head(200)
    out, _ = generate_traces(world["teacher"], lists, world["text"], fmt, TeacherConfig(mode="distill", ranked_positions=3))
    full, _ = generate_traces(world["teacher"], lists, world["text"], fmt, TeacherConfig(mode="distill"))
    text = world["text"]
    departs = 0
    for response, ranking, teacher_order, cands in zip(
        out["response"], out["ranking"].to_list(), full["ranking"].to_list(), lists["candidates"].to_list(), strict=True
    ):
        assert ranking == teacher_order[:3] + [c for c in cands if c not in teacher_order[:3]]
        parsed = parse_response(response, cands, text, fmt=fmt)
        assert parsed.valid_permutation and parsed.ranking == ranking
        assert response.startswith('{ "explanation" : " step 1 :')
        words = parsed.explanation.split()
        pos = [cands[int(w[5:-1]) - 1] for w in words if w.startswith("<pos_")]
        step2 = parsed.explanation.split(" step 2 : ")[1].split(" step 3 : ")[0].split()
        step3 = parsed.explanation.split(" step 3 : ")[1].split()
        first_cited = next(cands[int(w[5:-1]) - 1] for w in step2 if w.startswith("<pos_"))
        assert first_cited == ranking[0]
        assert [cands[int(w[5:-1]) - 1] for w in step3 if w.startswith("<pos_")] == ranking[:2]
        # Every citation is a position token followed by that candidate's semantic id.
        for i, w in enumerate(words):
            if w.startswith("<pos_"):
                assert words[i + 1 : i + 5] == text.sid_tokens(cands[int(w[5:-1]) - 1])
        assert set(pos) <= set(cands)
        departs += ranking != cands
    assert departs > 0
    # The sid format keeps the semantic-id-only citations.
    sid_out, _ = generate_traces(world["teacher"], lists.head(20), text, FormatConfig(), TeacherConfig(mode="distill"))
    assert not any("<pos_" in r for r in sid_out["response"])


def test_traces_keep_the_teachers_scores(world, traces) -> None:
    """Every trace carries the teacher's K scores in the incoming order (the soft target of the
    first decision); in distill mode their argmax is the ranking's first item."""
    out, _ = traces["distill"]
    lists = world["train"]
    for scores, ranking, cands in zip(out["teacher_scores"].to_list(), out["ranking"].to_list(), lists["candidates"].to_list(), strict=True):
        assert len(scores) == len(cands)
        assert cands[int(np.argmax(scores))] == ranking[0]


def test_scan_reasoning_keeps_the_best_so_far_with_its_evidence() -> None:
    """Every candidate in the incoming order with its levels, then `pick` and the best so
    far with its levels; a tie keeps the earlier candidate (a stable argsort's first)."""
    evidence = [[1, 4], [2, 7], [0, 3], [5, 5]]
    scores = [0.3, 0.9, 0.1, 0.9]
    steps = " ".join(scan_reasoning(evidence, scores)).split(" . ")
    assert steps[0] == "<pos_1> <ev1_1> <ev2_4> pick <pos_1> <ev1_1> <ev2_4>"
    assert steps[1] == "<pos_2> <ev1_2> <ev2_7> pick <pos_2> <ev1_2> <ev2_7>"
    assert steps[2] == "<pos_3> <ev1_0> <ev2_3> pick <pos_2> <ev1_2> <ev2_7>"
    assert steps[3] == "<pos_4> <ev1_5> <ev2_5> pick <pos_2> <ev1_2> <ev2_7> ."
    with pytest.raises(ValueError, match="3 candidates' evidence for 4 scores"):
        scan_reasoning(evidence[:3], scores)
    with pytest.raises(ValueError, match="needs evidence features"):
        scan_reasoning([[], []], [0.0, 1.0])


def test_scan_traces_work_out_the_decision_in_the_reasoning(world) -> None:
    """reasoning 'scan': step 2 scans every candidate with the evidence levels its prompt
    shows, the last pick is the answer's first item, and the response parses back to the
    ranking; a format without evidence or a mode other than distill is refused up front."""
    rng = np.random.default_rng(0)
    lists = world["train"].head(120)
    k = len(lists["candidates"][0])
    lists = lists.with_columns(
        pl.Series("evidence", [rng.integers(0, 8, size=(k, 2)).tolist() for _ in range(lists.height)], dtype=pl.List(pl.List(pl.Int8)))
    )
    fmt = FormatConfig(answer="index", evidence=("prerank_score", "co_after_all"), evidence_bins=((0.0,), (0.0,)))
    cfg = TeacherConfig(mode="distill", ranked_positions=3, reasoning="scan")
    out, _ = generate_traces(world["teacher"], lists, world["text"], fmt, cfg)
    departs = 0
    for response, ranking, cands, ev, scores in zip(
        out["response"], out["ranking"].to_list(), lists["candidates"].to_list(), lists["evidence"].to_list(),
        out["teacher_scores"].to_list(), strict=True,
    ):  # fmt: skip
        parsed = parse_response(response, cands, world["text"], fmt=fmt)
        assert parsed.valid_permutation and parsed.ranking == ranking
        step2 = parsed.explanation.split(" step 2 : ")[1].split(" step 3 : ")[0]
        assert step2.split() == scan_reasoning(ev, scores)
        steps = step2.split(" . ")
        assert len(steps) == k
        assert [s.split()[0] for s in steps] == [f"<pos_{i}>" for i in range(1, k + 1)]
        assert steps[-1].split()[3] == "pick" and cands[int(steps[-1].split()[4][5:-1]) - 1] == ranking[0]
        departs += ranking[0] != cands[0]
    assert departs > 0
    with pytest.raises(ValueError, match="needs answer 'index' and evidence"):
        generate_traces(world["teacher"], lists.head(2), world["text"], FormatConfig(answer="index"), cfg)
    with pytest.raises(ValueError, match="needs mode 'distill'"):
        TeacherConfig(mode="rejection", reasoning="scan")
