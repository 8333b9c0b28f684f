"""reports/index.html: written, self-contained, every section drawn from tiny synthetic metrics or skipped with a note.

No MLflow, no Prefect: the inputs are JSON files in tmp_path (with_mlflow=False).
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest

from flows.cli import main as gr2_main
from tasks.report import (
    REPORT_HTML, curves_from_history, format_headline, headline_metrics, load_inputs, parity_point, thin, write_report,
)  # fmt: skip
from tasks.report_html import render_html


def _m(r1: float, n: int = 50, **extra: object) -> dict[str, object]:
    return {
        "recall@1": r1, "recall@3": r1 + 0.2, "ndcg@3": r1 + 0.1, "valid_format_rate": 1.0, "valid_permutation_rate": 0.98,
        "copy_incoming_rate": 0.5, "n": n, "recall@1_ci95": [r1 - 0.05, r1 + 0.05], "ndcg@3_ci95": [r1, r1 + 0.2], **extra,
    }  # fmt: skip


def _speed_row(
    decoder: str, model: str, tau: float | None, speedup: float, r1: float, valid: float, batch: int = 1, sub: int | None = None, n: int = 2000,
) -> dict[str, object]:
    return {"decoder": decoder, "model": model, "tau": tau, "sub_block_size": sub, "batch_size": batch, "speedup": speedup,
            "recall@1": r1, "valid_format_rate": valid, "tokens_per_s": 100 * speedup, "n": n}  # fmt: skip


EVALUATE = {
    "prerank": {"test": _m(0.30)},
    "teacher": {"test": _m(0.33, **{"recall@1_vs_prerank": {"diff": 0.03, "ci95": [0.01, 0.05]}})},
    "gr2": {"test": _m(0.34, **{"recall@1_vs_prerank": {"diff": 0.04, "ci95": [0.02, 0.06]}})},
    "dgr2": {"test": _m(0.335, n=20, **{"recall@1_vs_gr2": {"diff": -0.005, "ci95": [-0.03, 0.02]}})},
    "spec-dgr2": {"test": _m(0.34, n=20)},
    "random": {"test": _m(0.1)},  # not an ablation row: left out of the table
}
SPEED = {
    "device": "cpu", "threads": 2, "examples": 8,
    "rows": [
        _speed_row("ar", "gr2", None, 1.0, 0.375, 1.0), _speed_row("hf", "gr2", None, 0.8, 0.375, 1.0),
        _speed_row("diffusion", "dgr2", 0.9, 1.6, 0.372, 0.995), _speed_row("diffusion", "dgr2", 0.5, 2.5, 0.30, 0.6),
        _speed_row("diffusion", "dgr2", 0.9, 1.2, 0.375, 1.0, sub=8),
    ],
}  # fmt: skip
RETRIEVE = {
    "full_ranking": {"test": {"popularity": {"recall@5": 0.01, "recall@10": 0.02, "ndcg@5": 0.005, "ndcg@10": 0.007, "n": 9},
                              "prerank": {"recall@5": 0.07, "recall@10": 0.0928, "ndcg@5": 0.05, "ndcg@10": 0.0575, "n": 9}}},
    "rerank": {"test": {"recall@1": 0.32, "recall@3": 0.58, "recall@5": 0.74, "ndcg@3": 0.47, "coverage": 0.09, "n": 20, "n_examples": 200}},
    "k": 10,
}  # fmt: skip
PREPARE = {"format": "sequence", "users": 22363, "items": 12101, "interactions": 198502, "avg_seq_len": 8.88, "load_s": 0.3}
SFT = {"final_train_loss": 0.1, "seconds": 12.0, "history": [{"step": s, "loss": 2.0 / s, "lr": 1e-3} for s in range(1, 30)]}
RL = {"reward_mean_last": 0.2, "history": [{"step": s, "reward_mean": 0.1 * s, "kept_groups": s, "sampled_groups": 10} for s in range(1, 6)]}


def _workspace(tmp_path: Path, **files: dict[str, object]) -> Path:
    (tmp_path / "metrics").mkdir()
    for name, data in files.items():
        (tmp_path / "metrics" / f"{name}.json").write_text(json.dumps(data))
    return tmp_path


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(d) for d in re.findall(r'<img [^>]*src="data:image/svg\+xml;base64,([^"]+)"', page)]


def _assert_self_contained(page: str) -> None:
    # Nothing the page loads may come from elsewhere: every src/href is a data URI or an in-page anchor.
    refs = re.findall(r'(?:src|href)\s*=\s*"([^"]*)"', page)
    assert refs
    assert all(r.startswith(("data:", "#")) for r in refs), [r for r in refs if not r.startswith(("data:", "#"))]
    assert "<script" not in page and "<link" not in page and "@import" not in page


def test_full_report_has_every_section(tmp_path: Path) -> None:
    root = _workspace(tmp_path, evaluate=EVALUATE, speed=SPEED, retrieve=RETRIEVE, prepare=PREPARE, sft=SFT, rl=RL)
    path = write_report(load_inputs(root, with_mlflow=False, with_registry=False))
    assert path == root / REPORT_HTML
    page = path.read_text()
    _assert_self_contained(page)
    for model in ("prerank", "teacher", "gr2", "dgr2", "spec-dgr2"):
        assert f"<td>{model}</td>" in page
    assert "<td>random</td>" not in page
    assert "+0.0400 [+0.0200, +0.0600]" in page  # R@1 - prerank with its interval
    assert "[0.2500, 0.3500]" in page  # prerank's R@1 interval
    assert "1.60x (dgr2, tau 0.9)" in page  # the parity point at batch 1
    assert "<td>22,363</td>" in page and "load_s" not in page  # data statistics, timings left out
    assert "<td>popularity</td>" in page and "0.0928" in page
    imgs = _images(page)
    # ablation, speed (one batch size), curves of sft and rl, the pre-ranker's bars
    assert len(imgs) == 5
    for svg in imgs:
        assert b"<svg" in svg[:2000] and len(svg) > 2000
        assert b"http://" not in svg.replace(b"http://www.w3.org", b"")  # namespaces only, nothing to fetch
    assert "No training curves" not in page and "could not be drawn" not in page
    assert "Registry: not read" in page


def test_missing_inputs_are_skipped_with_a_note(tmp_path: Path) -> None:
    root = _workspace(tmp_path, prepare=PREPARE)
    page = render_html(load_inputs(root, with_mlflow=False, with_registry=False))
    _assert_self_contained(page)
    for missing in ("No metrics/evaluate.json", "No metrics/speed.json rows", "No training curves", "No metrics/retrieve.json"):
        assert missing in page
    assert "<td>22,363</td>" in page
    assert _images(page) == []


def test_a_broken_section_does_not_cost_the_report(tmp_path: Path) -> None:
    root = _workspace(tmp_path, evaluate={"gr2": {"test": {"recall@1": "oops"}}}, prepare=PREPARE)
    page = render_html(load_inputs(root, with_mlflow=False, with_registry=False))
    assert "<td>22,363</td>" in page  # later sections still drawn
    assert "This section could not be drawn: ValueError" in page  # R@1 "oops" cannot be plotted


def test_unreadable_metrics_file_is_skipped(tmp_path: Path) -> None:
    root = _workspace(tmp_path, prepare=PREPARE)
    (root / "metrics" / "evaluate.json").write_text("{not json")
    inputs = load_inputs(root, with_mlflow=False, with_registry=False)
    assert inputs.evaluate is None and "prepare" in inputs.stage_metrics


def test_parity_point_is_fastest_setting_that_matches_ar() -> None:
    rows = SPEED["rows"]
    assert parity_point(rows, 1)["speedup"] == 1.6  # 2.5x loses too much R@1 and validity
    assert parity_point(rows, 1, tolerance=0.001)["speedup"] == 1.2  # only the sub-block row equals AR's R@1
    assert parity_point(rows, 16) is None  # no AR row at that batch size
    assert parity_point([r for r in rows if r["decoder"] != "diffusion" or r["tau"] == 0.5], 1) is None


def test_parity_needs_enough_examples_or_every_example() -> None:
    """On 64 examples one lucky hit (1/64 of R@1) is three times the tolerance: such a row cannot
    establish parity. A row that evaluate decoded on every example is judged on that instead."""
    ar = _speed_row("ar", "gr2", None, 1.0, 0.359, 1.0, n=64)
    lucky = _speed_row("diffusion", "dgr2", 0.5, 2.9, 0.375, 1.0, n=64)
    careful = {**_speed_row("diffusion", "dgr2", 0.9, 0.84, 0.344, 1.0, sub=8, n=64),
               "every_example_recall@1_vs_gr2": -0.0023, "every_example_valid_format_rate": 1.0}  # fmt: skip
    assert parity_point([ar, lucky], 1) is None
    assert parity_point([ar, lucky, careful], 1) is careful  # 0.344 on the 64, but within 0.005 on every example
    assert parity_point([ar, {**careful, "every_example_recall@1_vs_gr2": -0.006}], 1) is None


def test_curves_from_history_and_signal_share() -> None:
    series = curves_from_history("rl", RL["history"])
    assert list(series) == ["reward_mean", "signal_share"]
    assert series["signal_share"] == [(s, s / 10) for s in range(1, 6)]
    assert "lr" not in curves_from_history("sft", SFT["history"])
    long = [(i, float(i)) for i in range(10_001)]
    thinned = thin(long, 100)
    assert len(thinned) <= 102 and thinned[0] == long[0] and thinned[-1] == long[-1]


def test_headlines() -> None:
    assert format_headline(headline_metrics("retrieve", RETRIEVE)) == "R@10 0.0928, rerank R@1 0.3200"
    assert format_headline(headline_metrics("prepare", PREPARE)) == "users 22,363, items 12,101"
    assert format_headline(headline_metrics("opd", {"kl_last": 0.93561, "tokens_per_forward_last": 2.2237})) == "KL 0.9356, tokens/forward 2.22"
    ev = headline_metrics("evaluate", EVALUATE, SPEED)
    assert format_headline(ev) == "gr2 valid perm 0.9800, gr2 R@1 0.3400, speed-up at parity 1.60x"
    assert headline_metrics("sft", None) == []


def test_gr2_report_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ws").mkdir()
    root = _workspace(tmp_path / "ws", evaluate=EVALUATE, prepare=PREPARE)
    assert gr2_main(["report", "--root", str(root), "--no-mlflow"]) == 0
    assert (root / REPORT_HTML).exists()
    assert str(root / REPORT_HTML) in capsys.readouterr().out
    assert not list((root / "reports").glob(".index.html.*"))  # the temporary name was renamed away
    assert gr2_main(["report", "--root", str(tmp_path / "nowhere"), "--no-mlflow"]) == 2


def test_evaluate_writes_the_report_and_never_fails_on_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    import tasks.report
    from tasks.evaluate import write_html_report
    from tasks.tracking import StageTracker

    root = _workspace(tmp_path, prepare=PREPARE)  # no metrics/evaluate.json yet: the stage passes its results
    log = logging.getLogger("test.evaluate")
    write_html_report(root, EVALUATE, log, StageTracker(None))
    assert "<td>spec-dgr2</td>" in (root / REPORT_HTML).read_text()

    def broken(*args: object, **kwargs: object) -> Path:
        raise RuntimeError("no fonts")

    monkeypatch.setattr(tasks.report, "write_report", broken)
    with caplog.at_level(logging.WARNING):
        write_html_report(root, EVALUATE, log, StageTracker(None))
    assert "reports/index.html not written (RuntimeError: no fonts)" in caplog.text


def test_report_markdown_has_stage_headlines_ablation_parity_and_the_page(tmp_path: Path) -> None:
    """The flow publishes this as its `gr2-report` artifact."""
    from tasks.report import report_markdown

    root = _workspace(tmp_path, evaluate=EVALUATE, speed=SPEED, retrieve=RETRIEVE)
    summaries = [
        {"stage": "retrieve", "status": "skipped", "seconds": 0.0, "metrics": RETRIEVE},
        {"stage": "evaluate", "status": "ran", "seconds": 61.25, "metrics": EVALUATE},
    ]
    md = report_markdown(root, summaries)
    assert "| retrieve | skipped (up to date) | 0.0 | R@10 0.0928, rerank R@1 0.3200 |" in md
    assert "| evaluate | ran | 61.2 | gr2 valid perm 0.9800, gr2 R@1 0.3400, speed-up at parity 1.60x |" in md
    assert "| prerank | 0.3000 | [0.2500, 0.3500] | 0.9800 | 50 |" in md and "| spec-dgr2 | 0.3400 |" in md
    assert "| random |" not in md
    assert "Speed-up at parity (batch 1): 1.60x (dgr2, tau 0.9)." in md
    assert "No reports/index.html yet" in md
    write_report(load_inputs(root, with_mlflow=False, with_registry=False))
    assert f"file://{root.resolve() / REPORT_HTML}" in report_markdown(root, summaries)
