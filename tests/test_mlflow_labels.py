"""What MLflow's UI shows first: the experiment's kind (training runs, not GenAI traces) and the registry's descriptions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_run_states import own_store  # noqa: F401  (the per-test MLflow store fixture)

from flows.registry import MODEL_STAGES, version_description
from tasks.tracking import EXPERIMENT_KIND

EVAL = {"test": {"recall@1": 0.3372, "recall@1_ci95": [0.317, 0.357], "recall@1_vs_prerank": {"diff": 0.0149, "ci95": [0.0058, 0.0246]},
                 "ndcg@3": 0.4765, "valid_permutation_rate": 0.9986, "n": 2076}}  # fmt: skip


def test_experiment_is_tagged_as_model_training_new_or_old(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_store: str) -> None:  # noqa: F811
    import mlflow

    from tasks.tracking import experiment_id

    key, kind = EXPERIMENT_KIND
    monkeypatch.setenv("GR2_EXPERIMENT", "fresh")
    assert mlflow.get_experiment(experiment_id(tmp_path)).tags.get(key) == kind
    # An experiment made before the tag existed gets it on its next use.
    old = mlflow.create_experiment("old")
    monkeypatch.setenv("GR2_EXPERIMENT", "old")
    assert experiment_id(tmp_path) == old
    assert mlflow.get_experiment(old).tags.get(key) == kind


def test_version_description_names_model_stage_checkpoint_and_numbers(tmp_path: Path) -> None:
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/ar_rl.json").write_text(json.dumps({"reward_mean_last": 0.0648, "valid_last": 0.9988}))
    spec = MODEL_STAGES["ar_rl"]
    before = version_description(spec, tmp_path, "abc.dir")
    assert before.startswith("gr2 made by stage `ar_rl` (DAPO")
    assert "checkpoints/gr2, DVC md5 abc.dir" in before and "reward 0.0648, valid 0.9988" in before
    assert "Evaluation" not in before
    after = version_description(spec, tmp_path, "abc.dir", EVAL)
    assert "Evaluation (test, n=2076): R@1 0.3372 [0.3170, 0.3570], R@1 - pre-rank order +0.0149 [+0.0058, +0.0246]" in after
    assert "valid permutations 0.9986" in after


def test_registry_prints_go_to_the_log_file_not_the_quiet_console(tmp_path: Path, own_store: str) -> None:  # noqa: F811
    """MLflow prints "Created version ..." straight to stderr; around registration it is logged instead."""
    import io

    import mlflow

    from flows.console import setup_run_logging
    from flows.registry import log as registry_log
    from flows.registry import mlflow_prints_to_log

    source = tmp_path / "model"  # a plain folder: registering it prints the same lines as a logged model
    source.mkdir()
    out = io.StringIO()
    run_log = setup_run_logging(tmp_path, stream=out, run_name="reg")
    try:
        with mlflow_prints_to_log(registry_log):
            mlflow.register_model(source.as_uri(), "m")
            mlflow.register_model(source.as_uri(), "m")
    finally:
        run_log.close()
    assert out.getvalue() == ""
    log = (tmp_path / "logs/reg.log").read_text()
    assert "Successfully registered model 'm'" in log and "Created version '2' of model 'm'" in log
    assert "already exists" in log
