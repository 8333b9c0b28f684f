"""Speculative decoding wired into the decode benchmark and the evaluation: rows, counts, equality with GR2."""

from __future__ import annotations

import polars as pl
import pytest

from gr2model.eval.bench import SPEC_FIELDS, decode_benchmark, speed_table
from gr2model.models.block_diffusion import convert_to_block_diffusion
from gr2model.task.rerank_format import FormatConfig

from tiny import TOY_CANDIDATES, randomize, toy_items, toy_model, toy_tokenizer

FMT = FormatConfig(history_len=1, with_attributes=False)


@pytest.fixture(scope="module")
def setup():
    tok = toy_tokenizer()
    # Random weights of a larger scale: confident, varied tokens (no near-ties), so
    # equal outputs mean something.
    ar = randomize(toy_model(tok), 0.3).eval()
    dgr2 = convert_to_block_diffusion(ar, tok, block_size=4).eval()
    other = randomize(convert_to_block_diffusion(ar, tok, block_size=4), 0.3, seed=7).eval()  # a poor drafter
    lists = pl.DataFrame(
        {"history": [[], [1], [2], [3]], "candidates": [list(c) for c in TOY_CANDIDATES[:4]], "target": [1, 2, 3, 4]}
    )
    return tok, ar, dgr2, other, lists


def test_benchmark_spec_rows(setup) -> None:
    tok, ar, dgr2, other, lists = setup
    rows = decode_benchmark(
        ar, {"d": dgr2}, tok, lists, toy_items(), FMT, taus=[0.9], batch_sizes=[1, 2], max_new_tokens=12,
        drafters={"d": dgr2, "bad": other}, draft_len=3, draft_steps=2,
    )  # fmt: skip
    assert [(r["decoder"], r["model"], r["batch_size"]) for r in rows] == [
        (d, m, b) for b in (1, 2) for d, m in (("ar", "gr2"), ("hf", "gr2"), ("diffusion", "d"), ("spec", "d"), ("spec", "bad"))
    ]
    for r in rows:
        if r["decoder"] != "spec":
            assert all(r[f] is None for f in SPEC_FIELDS)
            continue
        ar_row = next(a for a in rows if a["decoder"] == "ar" and a["batch_size"] == r["batch_size"])
        assert r["equal_to_gr2"] == 1.0
        # GR2's own answers: the same length and accuracy as the AR row.
        assert r["response_tokens"] == ar_row["response_tokens"] and r["n"] == ar_row["n"] == 4
        assert r["recall@1"] == ar_row["recall@1"] and r["valid_format_rate"] == ar_row["valid_format_rate"]
        assert (r["draft_len"], r["draft_steps"], r["tau"]) == (3, 2, None)
        assert 0.0 <= r["mean_accepted_length"] <= 3
        assert r["ar_forwards_per_token"] + r["draft_forwards_per_token"] == pytest.approx(r["nfe_per_token"])
        assert r["ar_forwards_per_token"] > 0 and r["draft_forwards_per_token"] > 0
        assert r["speedup"] == r["speedup"] and r["tokens_per_s"] > 0  # measured, not NaN
    spec = {(r["model"], r["batch_size"]): r for r in rows if r["decoder"] == "spec"}
    # The converted GR2 drafts GR2's tokens better than a random network does.
    assert spec[("d", 1)]["mean_accepted_length"] > spec[("bad", 1)]["mean_accepted_length"]
    table = speed_table(rows)
    assert "| equal_to_gr2 |" in table.splitlines()[0] and "mean_accepted_length" in table
    assert {r["draft_mode"] for r in spec.values()} == {"block"}
    assert "equal_to_gr2" not in speed_table([r for r in rows if r["decoder"] != "spec"])
    with pytest.raises(ValueError):
        decode_benchmark(ar, {}, tok, lists, toy_items(), FMT, taus=[0.9], batch_sizes=[1], max_new_tokens=4, drafters={"d": dgr2}, draft_len=0)
    # A partial last batch (4 examples in batches of 3): forwards count the rows each batch really had.
    (r3,) = [r for r in decode_benchmark(
        ar, {}, tok, lists, toy_items(), FMT, taus=[0.9], batch_sizes=[3], max_new_tokens=12, drafters={"d": dgr2}, draft_len=3,
    ) if r["decoder"] == "spec"]  # fmt: skip
    assert r3["equal_to_gr2"] == 1.0
    assert r3["ar_forwards_per_token"] + r3["draft_forwards_per_token"] == pytest.approx(r3["nfe_per_token"])
    assert r3["ar_forwards_per_token"] < spec[("d", 1)]["ar_forwards_per_token"] * 1.5  # not inflated by the empty rows


def test_benchmark_window_drafting(setup) -> None:
    """The window drafter's rows: GR2's answers too, at each batch size, and their mode in the row."""
    tok, ar, dgr2, other, lists = setup
    rows = decode_benchmark(
        ar, {}, tok, lists, toy_items(), FMT, taus=[0.9], batch_sizes=[1, 3], max_new_tokens=12,
        drafters={"d": dgr2}, draft_len=3, draft_steps=1, draft_mode="window",
    )  # fmt: skip
    spec = [r for r in rows if r["decoder"] == "spec"]
    assert [r["batch_size"] for r in spec] == [1, 3]
    for r in spec:
        assert r["equal_to_gr2"] == 1.0 and r["draft_mode"] == "window" and 0.0 < r["mean_accepted_length"] <= 3
    with pytest.raises(ValueError, match="draft mode"):
        decode_benchmark(ar, {}, tok, lists, toy_items(), FMT, taus=[0.9], batch_sizes=[1], max_new_tokens=4,
                         drafters={"d": dgr2}, draft_mode="blocks")  # fmt: skip


def test_evaluate_spec_row_equals_gr2(setup) -> None:
    from tasks.evaluate import EvaluateConfig, SPEC_PREFIX, _decode_eval, add_intervals, spec_eval, spec_report

    tok, ar, dgr2, other, lists = setup
    cfg = EvaluateConfig(batch_size=3, max_new_tokens=12, bench={"spec_draft_len": 3, "spec_steps": 2})
    items = toy_items()
    gr2_m, gr2_ranks, gr2_out = _decode_eval("gr2", ar, tok, lists, items, FMT, cfg)
    results, ranks = {"gr2": {"test": gr2_m}}, {"gr2": {"test": gr2_ranks}}
    for drafter_name, drafter in (("dgr2", dgr2), ("bad", other)):
        # On the first 3 examples, as the diffusion rows with diffusion_max_examples.
        name = SPEC_PREFIX + drafter_name
        m, r, parsed = spec_eval(name, ar, drafter, tok, lists.head(3), items, FMT, cfg, gr2_out.sequences[:3])
        assert m["equal_to_gr2_rate"] == 1.0 and m["n"] == 3
        # Its answers are kept, to check a served spec-gr2 against: GR2's own rankings.
        assert [p.ranking for p in parsed] == [p.ranking for p in gr2_out.parsed[:3]]
        assert (m["draft_len"], m["draft_steps"]) == (3, 2) and 0.0 <= m["mean_accepted_length"] <= 3
        assert m["ar_forwards_per_token"] > 0 and m["draft_forwards_per_token"] > 0
        assert (r == gr2_ranks[:3]).all()
        results[name], ranks[name] = {"test": m}, {"test": r}
    # A different reference is caught.
    wrong = [s[:-1] for s in gr2_out.sequences[:3]]
    assert spec_eval("x", ar, dgr2, tok, lists.head(3), items, FMT, cfg, wrong)[0]["equal_to_gr2_rate"] == 0.0
    # Paired against gr2 like the diffusion rows: identical answers, a zero difference.
    ranks["prerank"] = {"test": gr2_ranks * 0}
    results["prerank"] = {"test": {}}
    add_intervals(results, ranks, n_boot=50, seed=0)
    assert results["spec-dgr2"]["test"]["recall@1_vs_gr2"] == {"diff": 0.0, "ci95": [0.0, 0.0]}
    text = spec_report(results, ["valid", "test"])
    assert "spec-dgr2 (test, 3 examples): tokens equal to GR2's greedy answers on 1.0000" in text and "spec-bad" in text
    assert spec_report({"gr2": results["gr2"]}, ["test"]) == ""


def test_spec_drafter_is_the_first_that_exists() -> None:
    from tasks.evaluate import EvaluateConfig, pick_spec_drafter

    available = {"dgr2-naive": 0, "dgr2-cft": 0, "dgr2-opd": 0}
    assert pick_spec_drafter(EvaluateConfig().spec_drafter, available) is None  # default [dgr2]: not trained yet
    assert pick_spec_drafter(["dgr2", "dgr2-opd", "dgr2-cft"], available) == "dgr2-opd"
    assert pick_spec_drafter([], available) is None


class _Tracker:
    def log_artifact(self, path) -> None: ...

    def log_metrics(self, metrics, step=None) -> None: ...


def _fake_workspace(monkeypatch, tmp_path, setup, drafters: dict):
    """tasks.evaluate.run on toy models: its loaders replaced, the checkpoints' folders present."""
    import types

    import numpy as np

    import tasks.evaluate as ev
    from tiny import items_table

    tok, ar, dgr2, other, lists = setup
    lists = lists.with_columns(target_rank=pl.lit(0), cand_scores=pl.col("candidates").list.eval(pl.element() * 0.0))
    teacher = types.SimpleNamespace(score=lambda hist, cands, scores: np.zeros(len(cands)))
    monkeypatch.setattr(ev, "load_prepared", lambda path: (types.SimpleNamespace(items=items_table(), num_items=4), {"train": pl.Series([[1, 2]])}))
    monkeypatch.setattr(ev, "load_teacher", lambda *a, **k: teacher)
    monkeypatch.setattr(ev, "load_format", lambda root: FMT)
    monkeypatch.setattr(ev, "load_lists", lambda root, split: lists)
    monkeypatch.setattr(ev, "load_hf_checkpoint", lambda path: (ar, tok))
    monkeypatch.setattr(ev, "diffusion_models", lambda root, block_size: {ev.NAIVE: (dgr2, tok), **drafters})
    for ckpt in ("gr2", "dgr2"):
        (tmp_path / "checkpoints" / ckpt).mkdir(parents=True)
    return ev


def test_evaluate_run_writes_the_spec_row_and_rows(monkeypatch, tmp_path, setup, caplog) -> None:
    import json
    import logging

    tok, ar, dgr2, other, lists = setup
    ev = _fake_workspace(monkeypatch, tmp_path, setup, {"dgr2": (dgr2, tok)})
    bench = {"taus": [0.9], "batch_sizes": [2], "examples": 2, "models": [], "spec_models": ["dgr2", "dgr2-opd"], "spec_draft_len": 3}
    cfg = ev.EvaluateConfig(splits=["test"], batch_size=2, max_new_tokens=8, diffusion_max_examples=3, bootstrap=20, bench=bench)
    log = logging.getLogger("test.evaluate")
    with caplog.at_level(logging.INFO, logger="test.evaluate"):
        results = ev.run(cfg, tmp_path, log, _Tracker())
    spec = results["spec-dgr2"]["test"]
    assert spec["equal_to_gr2_rate"] == 1.0 and spec["n"] == 3 and spec["draft_len"] == 3
    assert spec["recall@1_vs_gr2"] == {"diff": 0.0, "ci95": [0.0, 0.0]}
    assert any("spec-dgr2 on test (3 examples" in r.message and "done in" in r.message for r in caplog.records)
    assert "## Speculative decoding" in (tmp_path / "reports/evaluate.md").read_text()
    speed = json.loads((tmp_path / "metrics/speed.json").read_text())
    assert [(r["decoder"], r["model"]) for r in speed["rows"]] == [("ar", "gr2"), ("hf", "gr2"), ("spec", "dgr2")]
    assert speed["rows"][2]["equal_to_gr2"] == 1.0 and "equal_to_gr2" in speed["fields"]
    assert "| equal_to_gr2 |" in (tmp_path / "reports/speed.md").read_text()


def test_evaluate_run_skips_the_spec_row(monkeypatch, tmp_path, setup, caplog) -> None:
    import logging

    ev = _fake_workspace(monkeypatch, tmp_path, setup, {})  # no dgr2 checkpoint
    bench = {"taus": [0.9], "batch_sizes": [2], "examples": 2, "models": [], "spec_models": []}
    log = logging.getLogger("test.evaluate")
    for spec_row in (True, False):
        cfg = ev.EvaluateConfig(splits=["test"], batch_size=2, max_new_tokens=4, bootstrap=20, spec_row=spec_row, bench=bench)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="test.evaluate"):
            results = ev.run(cfg, tmp_path, log, _Tracker())
        assert not any(m.startswith("spec-") for m in results)
        skipped = [r.message for r in caplog.records if r.message.startswith("spec row skipped")]
        assert skipped == (["spec row skipped: no checkpoint of any drafter in evaluate.spec_drafter ['dgr2']"] if spec_row else [])
