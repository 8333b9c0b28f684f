"""The generated results page (`gr2 results`, tasks/results.py) on small hand-made metrics."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from flows.cli import main
from tasks.results import (
    RESULTS_BEGIN,
    RESULTS_END,
    ResultsError,
    ablation_rows,
    diffusion_ladder,
    load_results,
    model_order,
    read_stamp,
    render_results,
    replace_block,
    speed_summary,
    write_results,
)


def _m(r1: float, ndcg3: float, *, vs_prerank: float | None = None, vs_gr2: float | None = None, **extra: float) -> dict:
    """One {metric: value} dict in evaluate.json's shape (intervals around the point, for the check)."""
    m = {"recall@1": r1, "recall@1_ci95": [r1 - 0.01, r1 + 0.01], "ndcg@3": ndcg3, "ndcg@3_ci95": [ndcg3 - 0.02, ndcg3 + 0.02], "n": 2076, **extra}
    if vs_prerank is not None:
        m["recall@1_vs_prerank"] = {"diff": vs_prerank, "ci95": [vs_prerank - 0.009, vs_prerank + 0.009]}
        m["ndcg@3_vs_prerank"] = {"diff": vs_prerank, "ci95": [vs_prerank - 0.006, vs_prerank + 0.006]}
    if vs_gr2 is not None:
        m["recall@1_vs_gr2"] = {"diff": vs_gr2, "ci95": [vs_gr2 - 0.007, vs_gr2 + 0.007]}
    return m


EVALUATE = {
    "prerank": {"test": _m(0.3223, 0.4701, valid_permutation_rate=1.0, copy_incoming_rate=1.0)},
    "dgr2": {"test": _m(0.3264, 0.4717, vs_prerank=0.0041, vs_gr2=0.0, valid_permutation_rate=0.961, copy_incoming_rate=0.94, top1_agreement_vs_gr2=0.93, tokens_per_forward=2.47)},
    "gr2": {"test": _m(0.3372, 0.4765, vs_prerank=0.0149, valid_permutation_rate=0.9986, copy_incoming_rate=0.873)},
    "gr2+grammar": {"test": _m(0.3372, 0.4765, vs_prerank=0.0149, valid_permutation_rate=1.0, copy_incoming_rate=0.873, grammar_changed_rate=0.0014)},
    "new-row": {"test": _m(0.30, 0.45)},
}


def _workspace(tmp: Path, evaluate: object = EVALUATE) -> Path:
    """A workspace with dvc.yaml, the metrics and a dvc.lock recording evaluate.json's md5."""
    (tmp / "metrics").mkdir(parents=True)
    (tmp / "dvc.yaml").write_text("stages:\n  prepare:\n    cmd: x\n  sft:\n    cmd: x\n  evaluate:\n    cmd: x\n")
    (tmp / "metrics" / "prepare.json").write_text(json.dumps({"users": 10, "seconds": 12.5}))
    (tmp / "metrics" / "sft.json").write_text(json.dumps({"seconds": 1931.0}))
    text = json.dumps(evaluate)
    (tmp / "metrics" / "evaluate.json").write_text(text)
    md5 = hashlib.md5(text.encode()).hexdigest()
    (tmp / "dvc.lock").write_text(
        "schema: '2.0'\nstages:\n  sft:\n    cmd: x\n    outs:\n    - path: checkpoints/gr2-sft\n      md5: abc123.dir\n"
        f"  evaluate:\n    cmd: x\n    outs:\n    - path: metrics/evaluate.json\n      md5: {md5}\n"
    )
    return tmp


def test_rows_follow_the_reading_order_and_carry_intervals() -> None:
    assert model_order(list(EVALUATE)) == ["prerank", "gr2", "gr2+grammar", "dgr2", "new-row"]
    rows = {r[0]: r for r in ablation_rows(EVALUATE, "test")}
    assert rows["`gr2`"] == [
        "`gr2`", "2,076", "0.3372 [0.3272, 0.3472]", "0.4765 [0.4565, 0.4965]",
        "+0.0149 [+0.0059, +0.0239]", "+0.0149 [+0.0089, +0.0209]", "0.9986", "0.8730",
    ]  # fmt: skip
    assert rows["`prerank`"][4:6] == ["-", "-"]  # no difference to itself
    assert rows["`new-row`"][4] == "-"  # a model the page does not know still gets its row
    assert ablation_rows(EVALUATE, "valid") == []


def test_ladder_lists_the_rungs_in_order() -> None:
    rungs = {name: {"test": _m(0.33, 0.47, vs_prerank=0.01, vs_gr2=-0.001, tokens_per_forward=2.0)} for name in ("dgr2", "dgr2-opd", "dgr2-naive", "dgr2-cft")}
    ladder = diffusion_ladder({**rungs, "gr2": EVALUATE["gr2"], "prerank": EVALUATE["prerank"]}, "test")
    names = [line.split(" | ")[0].removeprefix("| ") for line in ladder.splitlines()[2:]]
    assert names == ["`gr2`", "`dgr2-naive`", "`dgr2-cft`", "`dgr2-opd`", "`dgr2`"]


def test_ladder_only_with_diffusion_rows() -> None:
    ladder = diffusion_ladder(EVALUATE, "test")
    lines = ladder.splitlines()
    assert lines[0] == (
        "| model | R@1 | R@1 - gr2 | NDCG@3 - gr2 | R@1 - prerank | NDCG@3 - prerank | top-1 as GR2's | valid permutations "
        "| tokens per forward | grammar changed |"
    )
    assert lines[2].startswith("| `gr2` |") and lines[3].startswith("| `dgr2` |")  # GR2, then the rungs in order
    assert "| `dgr2` | 0.3264 [0.3164, 0.3364] | +0.0000 [-0.0070, +0.0070] | - | +0.0041 [-0.0049, +0.0131] | +0.0041 [-0.0019, +0.0101] | 0.9300 | 0.9610 | 2.47 | - |" in ladder
    assert diffusion_ladder({"gr2": EVALUATE["gr2"]}, "test") == ""


def test_speed_at_the_parity_point() -> None:
    ar = {"decoder": "ar", "batch_size": 1, "tokens_per_s": 1800.0, "speedup": 1.0, "recall@1": 0.33, "n": 64}
    fast = {"decoder": "diffusion", "model": "dgr2", "tau": 0.9, "sub_block_size": 8, "batch_size": 1, "speedup": 1.04,
            "tokens_per_forward": 2.63, "every_example_recall@1_vs_gr2": -0.0023, "every_example_valid_format_rate": 1.0}  # fmt: skip
    loose = {**fast, "tau": 0.5, "speedup": 2.5, "every_example_recall@1_vs_gr2": -0.02}  # outside the tolerance
    spec = {"decoder": "spec", "model": "dgr2", "batch_size": 1, "speedup": 1.08, "draft_mode": "window", "draft_len": 8, "mean_accepted_length": 3.03, "equal_to_gr2": 1.0}
    text = speed_summary({"rows": [ar, fast, loose, spec], "examples": 64, "device": "cpu", "threads": 2})
    assert "Parity point: `dgr2`, tau 0.9, sub-block 8" in text and "**1.04x**" in text and "-0.0023 against GR2" in text
    assert "| `dgr2` | window 8 | 1.08x | 3.03 | 1.000 |" in text
    assert "Parity point: none" in speed_summary({"rows": [ar, loose]})
    assert "No `metrics/speed.json`" in speed_summary(None)


def test_stamp_names_commit_and_dvc_lock_hashes(tmp_path: Path) -> None:
    ws = _workspace(tmp_path / "ws")
    no_git = read_stamp(ws)  # tmp folders are outside any repository
    assert no_git.commit is None and no_git.outs["sft"] == {"checkpoints/gr2-sft": "abc123.dir"} and no_git.evaluate_matches_lock is True
    git = ["git", "-C", str(ws), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "ws"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    (ws / "dvc.lock").write_text((ws / "dvc.lock").read_text() + "\n")  # a rerun rewrites dvc.lock: still clean
    stamp = read_stamp(ws)
    assert stamp.commit == head and not stamp.dirty
    (ws / "dvc.yaml").write_text((ws / "dvc.yaml").read_text() + "\n")
    assert read_stamp(ws).dirty
    page = render_results(load_results(ws), "ws")
    assert f"commit `{head[:12]}` (uncommitted changes)" in page and "| `sft` | `checkpoints/gr2-sft` | `abc123.dir` |" in page
    assert "| `sft` | 1,931.0 |" in page and "| `evaluate` | not recorded |" in page


def test_edited_metrics_are_flagged_against_dvc_lock(tmp_path: Path) -> None:
    ws = _workspace(tmp_path)
    (ws / "metrics" / "evaluate.json").write_text(json.dumps({**EVALUATE, "extra": {"test": _m(0.1, 0.1)}}))
    assert read_stamp(ws).evaluate_matches_lock is False
    assert "changed after the stage ran" in render_results(load_results(ws))


def test_readme_block_is_replaced_and_nothing_else() -> None:
    text = f"# t\n\nintro\n{RESULTS_BEGIN}\nold table\n{RESULTS_END}\n\nrest\n"
    new = replace_block(text, f"{RESULTS_BEGIN}\nnew\n{RESULTS_END}")
    assert new == f"# t\n\nintro\n{RESULTS_BEGIN}\nnew\n{RESULTS_END}\n\nrest\n"
    with pytest.raises(ResultsError, match="README.md: needs exactly one"):
        replace_block("no markers", "x", name="README.md")
    with pytest.raises(ResultsError, match="comes before"):
        replace_block(f"{RESULTS_END}\n{RESULTS_BEGIN}\n", "x")


def test_write_results_writes_the_page_and_the_readme_block(tmp_path: Path) -> None:
    ws = _workspace(tmp_path / "ws")
    readme = tmp_path / "README.md"
    readme.write_text(f"top\n{RESULTS_BEGIN}\nrun `gr2 results --root WS` to fill this\n{RESULTS_END}\nbottom\n")
    out = tmp_path / "docs" / "results.md"
    assert write_results(ws, out, readme) == [out, readme]
    block = readme.read_text().split(RESULTS_BEGIN)[1].split(RESULTS_END)[0]
    assert "[docs/results.md](docs/results.md)" in block and "| `gr2+grammar` | 2,076 |" in block
    assert readme.read_text().startswith("top\n") and readme.read_text().endswith(f"{RESULTS_END}\nbottom\n")
    page = out.read_text()
    assert page.startswith("# Results") and "## Ablation, test" in page and "No `metrics/speed.json`" in page
    # The same inputs give the same page: nothing in it depends on when it was written.
    write_results(ws, out, readme)
    assert out.read_text() == page
    # A page kept in the project names its workspace by what it was, not by a path on one machine.
    write_results(ws, out, readme, label="the default profile")
    assert "from `the default profile`" in out.read_text() and "from `the default profile`" in readme.read_text()
    assert str(ws) not in out.read_text()


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "evaluate.json: not found"),
        ("{not json", "evaluate.json: not valid JSON"),
        ("[1, 2]", "evaluate.json: expected a non-empty object"),
        ('{"gr2": {"test": 0.3}}', "evaluate.json: model 'gr2': expected"),
    ],
)
def test_missing_or_malformed_evaluate_names_the_file(tmp_path: Path, content: str | None, message: str) -> None:
    ws = _workspace(tmp_path)
    if content is None:
        (ws / "metrics" / "evaluate.json").unlink()
    else:
        (ws / "metrics" / "evaluate.json").write_text(content)
    with pytest.raises(ResultsError, match=message) as err:
        load_results(ws)
    assert str(ws / "metrics" / "evaluate.json") in str(err.value)


def test_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ws = _workspace(tmp_path / "ws")
    out = tmp_path / "results.md"
    assert main(["results", "--root", str(ws), "--out", str(out), "--no-readme"]) == 0 and out.is_file()
    (ws / "metrics" / "evaluate.json").unlink()
    assert main(["results", "--root", str(ws), "--out", str(out), "--no-readme"]) == 2
    assert "evaluate.json: not found" in capsys.readouterr().err
