"""`gr2 reproduce`: rebuilding a registered version from its lineage and comparing.

The comparison helpers are pure and tested on small dicts. The verdicts that
need no rebuild (dirty tree, unknown commit) use a registry of tag-only
versions. The real checks rebuild versions of the smoke run (session fixture
`smoke_run`) in a temporary git worktree from the data snapshot in the
workspace's DVC remote: GR2 after SFT (prepare -> retrieve -> traces -> midtrain -> sft)
in the default suite, the whole chain to the diffusion model (`-m slow`).
Both must reproduce bit for bit on a CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flows.reproduce import (
    BIT_FOR_BIT,
    NOT_REPRODUCED,
    NOT_REPRODUCIBLE,
    Report,
    ReproduceError,
    StageCheck,
    compare_metrics,
    compare_stage,
    is_timing,
    reproduce,
    resolve,
    source_data,
)

GR2 = str(Path(sys.executable).parent / "gr2")


def test_timings_are_not_compared() -> None:
    assert is_timing("seconds") and is_timing("train_s") and is_timing("bench.tokens_per_s") and is_timing("decode_s")
    assert not is_timing("recall@1") and not is_timing("loss") and not is_timing("valid.steps")
    checks = compare_metrics({"loss": 1.5, "seconds": 3.0, "nested": {"n": 4, "fmt": "sequence"}}, {"loss": 1.5, "seconds": 9.0, "nested": {"n": 4, "fmt": "sequence"}}, 0.0)
    assert [c.key for c in checks] == ["loss", "nested.fmt", "nested.n"]
    assert all(c.equal for c in checks)


def test_metric_tolerance() -> None:
    [c] = compare_metrics({"loss": 1.0}, {"loss": 1.0 + 1e-9}, 0.0)
    assert not c.equal and not c.close
    [c] = compare_metrics({"loss": 1.0}, {"loss": 1.0 + 1e-9}, 1e-6)
    assert not c.equal and c.close
    [c] = compare_metrics({"loss": 1.0}, {}, 1e-6)
    assert c.rebuilt is None and not c.close
    [c] = compare_metrics({"x": float("nan")}, {"x": float("nan")}, 0.0)
    assert c.equal


LOCK = {
    "prepare": {"deps": {"raw": "a.dir", "tasks/prepare.py": "p1"}, "outs": {"data/prepared": "b.dir", "metrics/prepare.json": "m1"}, "params": {"params.yaml": {"prepare": {"x": 1}}}},
    "retrieve": {"deps": {"data/prepared": "b.dir", "tasks/retrieve.py": "r1"}, "outs": {"checkpoints/retriever": "c.dir", "metrics/retrieve.json": "m2"}, "params": {}},
    "traces": {"deps": {"data/prepared": "b.dir", "/abs/external": "e.dir"}, "outs": {"data/traces": "t.dir"}, "params": {}},
}


def test_source_data_is_what_no_stage_produces() -> None:
    assert source_data(LOCK, ["prepare", "retrieve"]) == {"raw": "a.dir"}
    assert source_data(LOCK, ["prepare", "retrieve", "traces"]) == {"raw": "a.dir", "/abs/external": "e.dir"}


def test_compare_stage() -> None:
    same = compare_stage("prepare", LOCK["prepare"], {**LOCK["prepare"], "outs": {"data/prepared": "b.dir", "metrics/prepare.json": "other"}}, [])
    assert same.status == "identical"  # the metrics file differs by its timings only; its numbers are compared instead
    out = compare_stage("retrieve", LOCK["retrieve"], {**LOCK["retrieve"], "outs": {"checkpoints/retriever": "X.dir"}}, [])
    assert out.status == "outputs differ" and "checkpoints/retriever" in out.details[0]
    code = compare_stage("retrieve", LOCK["retrieve"], {**LOCK["retrieve"], "deps": {"data/prepared": "b.dir", "tasks/retrieve.py": "r2"}}, [])
    assert code.status == "inputs differ" and "tasks/retrieve.py" in code.details[0]
    [metric] = compare_metrics({"loss": 1.0}, {"loss": 2.0}, 0.0)
    assert compare_stage("retrieve", LOCK["retrieve"], LOCK["retrieve"], [metric]).status == "outputs differ"
    assert compare_stage("x", None, LOCK["retrieve"], []).status == "not recorded"


def test_report_text_ends_with_the_verdict() -> None:
    r = Report("gr2", "3", "sft", "a" * 40, NOT_REPRODUCED, ["first divergence at stage sft"], stages=[StageCheck("prepare", "identical"), StageCheck("sft", "outputs differ", ["out x"])])
    text = r.text()
    assert text.splitlines()[-1] == "NOT REPRODUCED: gr2 version 3 (stage sft): first divergence at stage sft"
    assert "sft            outputs differ" in text and not r.reproduced
    assert Report("gr2", "3", verdict=BIT_FOR_BIT).reproduced


# ---------------------------------------------------------------------------
# Verdicts decided from the tags alone


@pytest.fixture()
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import mlflow
    from mlflow import MlflowClient
    from mlflow.tracking._tracking_service import utils as tracking_utils

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # The CLI's MlflowClient() reads MLflow's global URI, which another test may have set:
    # set ours, and afterwards put back exactly what was there (as tests/test_promote.py does).
    before = tracking_utils._tracking_uri
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    mlflow.set_tracking_uri(store)
    subprocess.run(["git", "init", "-q", str(tmp_path / "proj")], check=True)
    client = MlflowClient(store, store)
    client.create_registered_model("gr2")

    def add(tags: dict[str, str], alias: str | None = None) -> str:
        mv = client.create_model_version("gr2", source="file:///nonexistent", tags=tags, await_creation_for=0)
        if alias:
            client.set_registered_model_alias("gr2", alias, str(mv.version))
        return str(mv.version)

    yield {"client": client, "add": add, "root": tmp_path / "proj"}
    mlflow.set_tracking_uri(before)


def test_dirty_tree_is_not_reproducible(registry: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    from flows.cli import main

    client, root = registry["client"], registry["root"]
    v = registry["add"]({"stage": "sft", "git.commit": "a" * 40, "git.dirty": "true", "checkpoint_md5": "x.dir"}, alias="champion")
    report = reproduce("gr2@champion", root=root, client=client)
    assert report.verdict == NOT_REPRODUCIBLE and "dirty git tree" in report.summary()
    assert client.get_model_version("gr2", v).tags["reproduce.verdict"] == NOT_REPRODUCIBLE
    assert main(["--root", str(root), "reproduce", "gr2", v]) == 1
    assert "NOT REPRODUCIBLE: gr2 version 1 (stage sft): registered from a dirty git tree" in capsys.readouterr().out


def test_unknown_commit_is_not_reproducible(registry: dict[str, Any]) -> None:
    v = registry["add"]({"stage": "sft", "git.commit": "b" * 40, "git.dirty": "false", "checkpoint_md5": "x.dir"})
    report = reproduce("gr2", v, root=registry["root"], client=registry["client"], record=False)
    assert report.verdict == NOT_REPRODUCIBLE and "is not in the repository" in report.summary()
    assert "reproduce.verdict" not in registry["client"].get_model_version("gr2", v).tags


def test_nothing_to_reproduce(registry: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    from flows.cli import main

    client = registry["client"]
    with pytest.raises(ReproduceError, match="no version aliased 'champion'"):
        resolve(client, "gr2@champion")
    with pytest.raises(ReproduceError, match="which version"):
        resolve(client, "gr2")
    v = registry["add"]({"git.dirty": "false"})
    with pytest.raises(ReproduceError, match="no pipeline stage tag"):
        reproduce("gr2", v, root=registry["root"], client=client)
    spec = {"stage": "evaluate", "verifier.model": "gr2", "verifier.model_version": "3", "drafter.model": "diffusion-gr2", "drafter.model_version": "5"}
    with pytest.raises(ReproduceError, match="reproduce its sources: gr2 version 3 and diffusion-gr2 version 5"):
        reproduce("gr2", registry["add"](spec), root=registry["root"], client=client)
    assert main(["--root", str(registry["root"]), "reproduce", "nosuch@champion"]) == 2
    assert "no version aliased" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# Real rebuilds of the smoke run's versions


def _reproduce_cli(ws: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{ws / 'mlflow.db'}", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("GR2_ROOT", None)
    return subprocess.run([GR2, "--root", str(ws), "reproduce", *args], env=env, capture_output=True, text=True, timeout=900)


def _check_bit_for_bit(ws: Path, model: str, version: str, proc: subprocess.CompletedProcess[str], stages: list[str]) -> None:
    from mlflow import MlflowClient

    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert out.strip().splitlines()[-1].startswith(f"REPRODUCED bit for bit: {model} version {version}")
    for stage in stages:
        assert f"{stage:<14} identical" in out, out
    # the snapshot came from the workspace's DVC remote by hash
    assert "data raw: " in out and f"restored from default remote 'storage' ({ws / 'dvc-remote'})" in out
    store = f"sqlite:///{ws / 'mlflow.db'}"
    tags = MlflowClient(store, store).get_model_version(model, version).tags
    assert tags["reproduce.verdict"] == BIT_FOR_BIT
    assert tags["checkpoint_md5"] in out
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=ws, capture_output=True, text=True, check=True).stdout
    assert len(worktrees.splitlines()) == 1, f"the temporary worktree was not removed:\n{worktrees}"


@pytest.mark.integration
def test_sft_model_reproduces_bit_for_bit(smoke_run: dict[str, Any]) -> None:
    """GR2 after SFT, rebuilt from commit + data hash: every stage's outputs and the checkpoint hash identical."""
    from mlflow import MlflowClient

    ws = smoke_run["ws"]
    store = f"sqlite:///{ws / 'mlflow.db'}"
    [mv] = [v for v in MlflowClient(store, store).search_model_versions("name = 'gr2'") if v.tags["stage"] == "sft"]
    assert mv.tags["git.dirty"] == "false" and mv.tags["runtime.omp_num_threads"]
    proc = _reproduce_cli(ws, "gr2", str(mv.version))
    _check_bit_for_bit(ws, "gr2", str(mv.version), proc, ["prepare", "retrieve", "traces", "midtrain", "sft"])


@pytest.mark.slow
@pytest.mark.integration  # reads the shared smoke run
def test_diffusion_model_reproduces_bit_for_bit(smoke_run: dict[str, Any]) -> None:
    """The whole chain to the diffusion model (RL sampling, trajectories, CFT included), by alias."""
    from mlflow import MlflowClient

    ws = smoke_run["ws"]
    store = f"sqlite:///{ws / 'mlflow.db'}"
    version = MlflowClient(store, store).get_model_version_by_alias("diffusion-gr2", "challenger").version
    proc = _reproduce_cli(ws, "diffusion-gr2@challenger")
    _check_bit_for_bit(ws, "diffusion-gr2", str(version), proc, ["prepare", "retrieve", "traces", "midtrain", "sft", "ar_rl", "trajectories", "cft"])
