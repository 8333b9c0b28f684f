"""Params checked before any work: `flows.pipeline.check_params`, which the flow and `gr2 run` call first.

Called directly (no Prefect, no stage): a bad value of any stage, or a rule between stages, fails with
the file and the dotted field, and `gr2 run` exits 2 leaving the workspace as it was.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.pipeline import check_params
from tasks.common import ParamsError

ROOT = Path(__file__).resolve().parents[1]


def _workspace(tmp_path: Path, **changes: Any) -> Path:
    """The project's params.yaml and dvc.yaml in `tmp_path`, with `changes` ("retrieve.train.lr": -1) applied."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = params
        for key in parents:
            node = node[key]
        node[last] = value
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    return tmp_path


def test_the_projects_params_pass(tmp_path: Path) -> None:
    check_params(_workspace(tmp_path))


def test_a_bad_value_of_a_late_stage_fails_before_the_first(tmp_path: Path) -> None:
    with pytest.raises(ParamsError) as err:
        check_params(_workspace(tmp_path, **{"retrieve.train.lr": -1, "evaluate.bench.repeats": 0}))
    lines = str(err.value).splitlines()
    assert any(line.startswith(f"{tmp_path / 'params.yaml'}: retrieve.train.lr") for line in lines), lines
    assert any("evaluate.bench.repeats" in line for line in lines), lines  # every problem, not only the first


def test_rules_inside_and_between_sections(tmp_path: Path) -> None:
    with pytest.raises(ParamsError) as err:
        check_params(_workspace(tmp_path, **{
            "traces.mode": "rejection", "traces.reasoning": "evidence", "evaluate.sub_block_size": 12,
            "evaluate.bench.sub_block_cache_sizes": [2],
        }))  # fmt: skip
    text = str(err.value)
    assert "traces.unlabelled_lists" in text and "needs mode 'distill'" in text
    with pytest.raises(ParamsError, match=r"traces\.reasoning: .*'scan' needs mode 'distill'"):
        check_params(_workspace(tmp_path, **{"traces.mode": "rejection", "traces.unlabelled_lists": 0}))
    assert "evaluate.sub_block_size: 12 does not divide cft.train.block_size 32" in text
    assert "evaluate.bench.sub_block_cache_sizes: [2] not among evaluate.bench.sub_block_sizes" in text


def test_promote_and_serve_sections_too(tmp_path: Path) -> None:
    with pytest.raises(ParamsError, match=r"promote.models.gr2.tolerence"):
        check_params(_workspace(tmp_path, **{"promote.models.gr2.tolerence": 0.1}))


def test_gr2_run_exits_2_and_leaves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from flows.cli import main

    root = _workspace(tmp_path, **{"retrieve.train.lr": -1})
    before = sorted(p.name for p in root.iterdir())
    assert main(["--root", str(root), "run"]) == 2
    err = capsys.readouterr().err
    assert "params.yaml: retrieve.train.lr" in err and "nothing was run" in err
    assert sorted(p.name for p in root.iterdir()) == before  # no log, no MLflow store, no outputs
