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


def test_stage_figures_are_logged_to_the_stage_run(tmp_path: Path, own_store: str) -> None:  # noqa: F811
    """Training curves from the run's own step metrics; evaluate's ablation and speed figures; PNGs MLflow previews."""
    import logging

    import mlflow
    from mlflow import MlflowClient
    from test_report import EVALUATE, SPEED

    from tasks.report import log_stage_figures

    client = MlflowClient()
    with mlflow.start_run(run_name="ar_rl") as run:
        for step in range(1, 6):
            mlflow.log_metrics({"reward_mean": 0.1 * step, "kept_groups": step, "sampled_groups": 8, "loss": 1.0 / step}, step=step)
    log = logging.getLogger("test.figures")
    assert log_stage_figures("ar_rl", {"reward_mean_last": 0.5}, client, run.info.run_id, tmp_path, log) == ["figures/ar_rl_training_curves.png"]
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/speed.json").write_text(json.dumps(SPEED))
    with mlflow.start_run(run_name="evaluate") as ev:
        pass
    logged = log_stage_figures("evaluate", EVALUATE, client, ev.info.run_id, tmp_path, log)
    assert logged == ["figures/evaluate_ablation_test.png", "figures/evaluate_speed_accuracy_batch1.png"]
    for run_id, paths in ((run.info.run_id, ["figures/ar_rl_training_curves.png"]), (ev.info.run_id, logged)):
        for path in paths:
            png = Path(client.download_artifacts(run_id, path, str(tmp_path / run_id))).read_bytes()
            assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    # A stage without figures logs nothing; a store that fails costs a warning, not the stage.
    assert log_stage_figures("prepare", {"users": 3}, client, run.info.run_id, tmp_path, log) == []
    assert log_stage_figures("ar_rl", {}, client, "no-such-run", tmp_path, log) == []
