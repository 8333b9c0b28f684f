"""One name per stage across dvc.yaml, params.yaml and tasks/; typed configs reject bad params clearly."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

from tasks.common import STAGES, ParamsError, atomic_dir, load_stage_config, write_json_atomic
from tasks.tracking import git_lineage

ROOT = Path(__file__).resolve().parents[1]
DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())


@pytest.mark.parametrize("stage", sorted(DVC))
def test_stage_name_is_shared(stage: str) -> None:
    assert stage in STAGES
    assert stage in PARAMS, f"params.yaml has no section '{stage}'"
    assert DVC[stage]["params"] == [stage]
    assert DVC[stage]["cmd"] == f"python -m tasks.{stage}"
    module = importlib.import_module(f"tasks.{stage}")
    assert module.STAGE == stage
    assert f"metrics/{stage}.json" in DVC[stage]["metrics"]
    # The code a stage runs is among its deps, so DVC reruns it when the code changes.
    assert f"tasks/{stage}.py" in DVC[stage]["deps"]


@pytest.mark.parametrize("stage", sorted(DVC))
def test_default_params_validate(stage: str) -> None:
    module = importlib.import_module(f"tasks.{stage}")
    load_stage_config(stage, module.CONFIG, ROOT / "params.yaml")


def test_bad_params_name_the_field(tmp_path: Path) -> None:
    from tasks.retrieve import RetrieveConfig

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["retrieve"]["train"]["lr"] = "fast"
    params["retrieve"]["typo_key"] = 1
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    with pytest.raises(ParamsError) as err:
        load_stage_config("retrieve", RetrieveConfig, path)
    assert "retrieve.train.lr" in str(err.value)
    assert "retrieve.typo_key" in str(err.value)
    assert str(path) in str(err.value)


def test_missing_params_file_and_section(tmp_path: Path) -> None:
    from tasks.prepare import PrepareConfig

    with pytest.raises(ParamsError, match="file not found"):
        load_stage_config("prepare", PrepareConfig, tmp_path / "params.yaml")
    (tmp_path / "params.yaml").write_text("retrieve: {}\n")
    with pytest.raises(ParamsError, match="no section 'prepare'"):
        load_stage_config("prepare", PrepareConfig, tmp_path / "params.yaml")


def test_atomic_dir_leaves_nothing_on_failure(tmp_path: Path) -> None:
    final = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as tmp:
            (tmp / "half.txt").write_text("x")
            raise RuntimeError("boom")
    assert not final.exists()
    assert list(tmp_path.iterdir()) == []
    with atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text("1")
    with atomic_dir(final) as tmp:  # replaces the previous content whole
        (tmp / "b.txt").write_text("2")
    assert sorted(p.name for p in final.iterdir()) == ["b.txt"]


def test_write_json_atomic(tmp_path: Path) -> None:
    path = tmp_path / "m" / "x.json"
    write_json_atomic({"a": 1}, path)
    assert path.read_text().strip() == '{\n  "a": 1\n}'
    with pytest.raises(TypeError):
        write_json_atomic({"a": object()}, path)
    assert path.read_text().strip() == '{\n  "a": 1\n}'
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]


def test_git_lineage_dirty_means_code_or_params_not_dvc_lock(tmp_path: Path) -> None:
    """The pipeline rewrites dvc.lock while it runs: that alone must not make a version dirty."""
    import subprocess

    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True, capture_output=True)

    assert git_lineage(tmp_path) == {"git.commit": "unknown", "git.dirty": "unknown"}
    git("init", "-q")
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\n")
    (tmp_path / "params.yaml").write_text("sft: {}\n")
    git("add", ".")
    git("commit", "-qm", "init")
    clean = git_lineage(tmp_path)
    assert len(clean["git.commit"]) == 40 and clean["git.dirty"] == "false"
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n")
    (tmp_path / "metrics.json").write_text("{}")  # untracked outputs do not count either
    assert git_lineage(tmp_path)["git.dirty"] == "false"
    (tmp_path / "params.yaml").write_text("sft: {epochs: 3}\n")
    assert git_lineage(tmp_path)["git.dirty"] == "true"
