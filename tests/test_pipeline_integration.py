"""The whole pipeline on the smoke profile: Prefect flow -> DVC stages -> MLflow runs and registry.

One workspace (a copy of the project with profiles/smoke.yaml applied, on a
slice of the real Beauty data) is run twice under Prefect's test harness: the
first run executes every stage, the second finds everything up to date. The
run is the session fixture `smoke_run` (tests/conftest.py), shared with the
promotion and serving tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import polars as pl
import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration


def _mlflow(ws: Path):
    import mlflow
    from mlflow import MlflowClient

    mlflow.set_tracking_uri(f"sqlite:///{ws / 'mlflow.db'}")
    return MlflowClient(f"sqlite:///{ws / 'mlflow.db'}")


def test_stages_run_in_dvc_order_then_skip(smoke_run: dict[str, Any]) -> None:
    import yaml

    stages = list(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])
    assert [s["stage"] for s in smoke_run["first"]] == stages
    assert stages[:2] == ["prepare", "retrieve"]
    assert all(s["status"] == "ran" for s in smoke_run["first"])
    assert all(s["status"] == "skipped" for s in smoke_run["second"])
    ws = smoke_run["ws"]
    status = subprocess.run([sys.executable, "-m", "dvc", "status"], cwd=ws, capture_output=True, text=True, check=True)
    assert "up to date" in status.stdout


def test_dvc_outputs_and_metrics(smoke_run: dict[str, Any]) -> None:
    ws = smoke_run["ws"]
    prep = json.loads((ws / "metrics/prepare.json").read_text())
    assert prep["users"] == 1500
    assert prep["sid_unique_share"] == 1.0
    ret = json.loads((ws / "metrics/retrieve.json").read_text())
    for split in ("valid", "test"):
        for model in ("popularity", "transition", "sasrec", "prerank"):
            assert 0.0 <= ret["full_ranking"][split][model]["recall@10"] <= 1.0
    for split in ("train", "valid", "test"):
        assert ret["rerank"][split]["n"] > 0
    for name in ("train", "valid", "test"):
        assert (ws / f"data/candidates/{name}.parquet").exists()
    assert (ws / "checkpoints/retriever/COMPLETE").exists()
    traces = json.loads((ws / "metrics/traces.json").read_text())
    assert traces["kept"] > 0 and 0.0 < traces["kept_rate"] <= 1.0
    # The student's ceilings: the LTR ranker on what the prompt shows, with and without its evidence.
    for key in ("prompt_ceiling", "prompt_evidence_ceiling"):
        assert 0.0 <= traces["valid_accuracy"][key]["recall@1"] <= 1.0
    fmt = json.loads((ws / "data/traces/format.json").read_text())
    assert len(fmt["evidence"]) == len(fmt["evidence_bins"]) > 0
    prompt = pl.read_parquet(ws / "data/traces/train.parquet")["prompt"][0]
    assert prompt.count("<ev1_") == prompt.count("<pos_")  # one level per candidate and feature
    for split in ("train", "valid", "test"):
        assert pl.read_parquet(ws / f"data/traces/evidence/{split}.parquet").height == pl.read_parquet(ws / f"data/candidates/{split}.parquet").height
    for ckpt in ("gr2-sft", "gr2", "dgr2-cft", "dgr2-opd", "dgr2"):
        assert (ws / f"checkpoints/{ckpt}/COMPLETE").exists()
    assert json.loads((ws / "checkpoints/dgr2-cft/config.json").read_text())["block_size"] == 32
    evaluation = json.loads((ws / "metrics/evaluate.json").read_text())
    for model in ("prerank", "teacher", "random", "gr2-sft", "gr2", "dgr2-naive", "dgr2-cft", "dgr2-opd", "dgr2"):
        for split in ("valid", "test"):
            m = evaluation[model][split]
            assert set(m) >= {"recall@1", "recall@3", "recall@5", "ndcg@3", "ndcg@5", "valid_format_rate", "valid_permutation_rate", "copy_incoming_rate", "n"}
            assert m["n"] > 0
    assert evaluation["prerank"]["test"]["copy_incoming_rate"] == 1.0
    # Reasoning first, the default: every row decodes as served, without a grammar (its validity is
    # what it wrote), and GR2 decodes once more with its explanation forced empty.
    assert fmt["answer_first"] is False and '"explanation" : "' in pl.read_parquet(ws / "data/traces/train.parquet")["response"][0][:20]
    for model in ("gr2", "gr2-no-reasoning", "dgr2-naive", "dgr2"):
        for split in ("valid", "test"):
            m = evaluation[model][split]
            assert "grammar_changed_rate" not in m and 0.0 <= m["valid_permutation_rate"] <= 1.0
            if model != "gr2":
                assert 0.0 <= m["top1_agreement_vs_gr2"] <= 1.0 and "recall@1_vs_gr2" in m
    assert not any(name.endswith("+grammar") for name in evaluation)  # grammar_rows is off by default
    # The speculative row: GR2 verifying dgr2's drafts, on the same examples as the gr2 row. Its tokens
    # must equal GR2's; a tiny smoke model may have floating-point near-ties, hence a majority here (the
    # exact check is tests/test_speculative_wiring.py on tiny random models, and the default run).
    for split in ("valid", "test"):
        spec = evaluation["spec-dgr2"][split]
        assert spec["n"] == evaluation["gr2"][split]["n"] and spec["equal_to_gr2_rate"] > 0.5
        assert spec["draft_len"] == 4 and "recall@1_vs_gr2" in spec
    assert "## Speculative decoding" in (ws / "reports/evaluate.md").read_text()
    speed = json.loads((ws / "metrics/speed.json").read_text())
    # smoke bench: batch sizes 1 and 4; AR (ours, HF) + dgr2-cft and dgr2 at two thresholds each,
    # whole blocks and sub-blocks of 8, + at each tau S 8 with the sub-block cache + GR2 verifying the
    # drafts of each drafter stage (naive, cft, opd, rl). No explanation-threshold rows: they need the
    # answer grammar, which covers the rank-first format only.
    assert len(speed["rows"]) == 2 * (2 + 2 * 2 * 2 + 2 * 2 + 4)
    diffusion_rows = [r for r in speed["rows"] if r["decoder"] == "diffusion"]
    assert all(r["grammar_changed_rate"] is None for r in diffusion_rows)  # decoded as served, no grammar
    assert sorted({(r["tau"], r["explanation_tau"]) for r in diffusion_rows}, key=str) == [(0.5, None), (0.9, None)]
    # evaluate's setting (tau 0.9, S 8, no cache) carries the every-example judgement
    table = [r for r in diffusion_rows if (r["tau"], r["sub_block_size"], r["sub_block_cache"]) == (0.9, 8, False)]
    assert table and all("every_example_recall@1_vs_gr2" in r for r in table)
    spec_rows = [r for r in speed["rows"] if r["decoder"] == "spec"]
    assert sorted((r["model"], r["batch_size"]) for r in spec_rows) == [
        (m, b) for m in ("dgr2", "dgr2-cft", "dgr2-naive", "dgr2-opd") for b in (1, 4)
    ]
    for r in spec_rows:
        assert r["equal_to_gr2"] > 0.5 and r["draft_len"] == 4 and r["mean_accepted_length"] >= 0
        assert abs(r["ar_forwards_per_token"] + r["draft_forwards_per_token"] - r["nfe_per_token"]) < 1e-9
    assert sorted({r["sub_block_size"] for r in speed["rows"] if r["decoder"] == "diffusion"}, key=str) == [8, None]
    cached = [r for r in diffusion_rows if r["sub_block_cache"]]
    assert len(cached) == 2 * 2 * 2 and all(r["sub_block_size"] == 8 and r["explanation_tau"] is None for r in cached)
    assert {r["model"] for r in speed["rows"] if r["decoder"] == "diffusion"} == {"dgr2-cft", "dgr2"}
    for row in speed["rows"]:
        assert set(row) >= {"decoder", "model", "tau", "batch_size", "tokens_per_s", "speedup", "nfe_per_token", "forward_cost", "projected_speedup", "response_tokens", "recall@1", "valid_format_rate"}
        assert row["tokens_per_s"] > 0 and row["nfe_per_token"] > 0
    for bs in (1, 4):
        ar = [r for r in speed["rows"] if r["batch_size"] == bs and r["decoder"] in ("ar", "hf")]
        assert max(r["speedup"] for r in ar) == 1.0  # speed-ups are relative to the faster AR decoder
    assert "| decoder |" in (ws / "reports/speed.md").read_text()
    assert "## Ablation (test" in (ws / "reports/evaluate.md").read_text()
    for stage in ("opd", "rl"):
        assert json.loads((ws / f"metrics/{stage}.json").read_text())["steps"] == 1
    for stage in ("ar_rl", "opd", "rl"):
        m = json.loads((ws / f"metrics/{stage}.json").read_text())
        # The reward's monitors, averaged over rollouts: valid JSON, valid permutation.
        assert 0.0 <= m["format_first"] <= 1.0 and 0.0 <= m["valid_first"] <= m["format_first"]
    lock = (ws / "dvc.lock").read_text()
    assert "checkpoints/retriever" in lock and "data/prepared" in lock


def test_evaluate_writes_the_offline_report(smoke_run: dict[str, Any]) -> None:
    page = (smoke_run["ws"] / "reports/index.html").read_text()
    for row in ("prerank", "gr2", "dgr2-naive", "dgr2"):
        assert f"<td>{row}</td>" in page
    assert page.count('src="data:image/svg+xml;base64,') >= 4  # ablation, speed, curves, pre-ranker
    assert "could not be drawn" not in page and "No training curves" not in page


def test_mlflow_nested_runs_with_lineage(smoke_run: dict[str, Any]) -> None:
    ws = smoke_run["ws"]
    client = _mlflow(ws)
    exp = client.get_experiment_by_name("diffusion-gr2")
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development", "MLflow's UI opens on the training runs"
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.info.run_name == "pipeline"]
    assert len(parents) == 2 and all(r.info.status == "FINISHED" for r in parents)
    import yaml

    stages = set(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])
    stage_runs = {r.info.run_name: r for r in runs if r.info.run_name in stages}
    # one run per stage execution: the second flow run executed nothing
    assert len([r for r in runs if r.info.run_name in stages]) == len(stages)
    first_parent = min(parents, key=lambda r: r.info.start_time)
    for name, run in stage_runs.items():
        assert run.data.tags["mlflow.parentRunId"] == first_parent.info.run_id
        assert run.data.tags["gr2.stage"] == name
        assert len(run.data.tags["git.commit"]) == 40
        assert run.info.status == "FINISHED"
    assert "dvc.out.checkpoints/retriever" in stage_runs["retrieve"].data.tags
    assert stage_runs["prepare"].data.metrics["users"] == 1500
    assert stage_runs["retrieve"].data.params["k"] == "10"
    losses = client.get_metric_history(stage_runs["retrieve"].info.run_id, "sasrec.loss")
    assert len(losses) >= 2, "per-epoch training metrics are logged"
    rewards = client.get_metric_history(stage_runs["ar_rl"].info.run_id, "reward_mean")
    assert sorted(m.step for m in rewards) == [1, 2], "per-step RL metrics are logged at their step"
    assert len(client.get_metric_history(stage_runs["sft"].info.run_id, "loss")) >= 2, "per-step SFT metrics are logged"


def test_retriever_registered_once_and_serves(smoke_run: dict[str, Any]) -> None:
    import mlflow.pyfunc
    import pandas as pd

    ws = smoke_run["ws"]
    client = _mlflow(ws)
    versions = client.search_model_versions("name = 'gr2-retriever'")
    assert len(versions) == 1, "the same checkpoint hash is registered once"
    v = versions[0]
    assert v.tags["stage"] == "retrieve"
    assert v.tags["checkpoint_md5"] == v.tags["dvc.out.checkpoints/retriever"]
    assert client.get_model_version_by_alias("gr2-retriever", "challenger").version == v.version
    assert smoke_run["second"][1]["registered"]["created"] is False
    gr2_versions = client.search_model_versions("name = 'gr2'")
    assert sorted(v.tags["stage"] for v in gr2_versions) == ["ar_rl", "sft"]
    assert client.get_model_version_by_alias("gr2", "challenger").tags["stage"] == "ar_rl"
    assert sorted(v.tags["stage"] for v in client.search_model_versions("name = 'diffusion-gr2'")) == ["cft", "opd", "rl"]
    assert client.get_model_version_by_alias("diffusion-gr2", "challenger").tags["stage"] == "rl"
    # The speculative re-ranker: the pair evaluate measured (GR2 verifying dgr2), once, traced to both versions.
    (spec,) = client.search_model_versions("name = 'spec-gr2'")
    by_stage = {v.tags["stage"]: v for v in [*gr2_versions, *client.search_model_versions("name = 'diffusion-gr2'")]}
    assert spec.tags["stage"] == "evaluate" and spec.tags["drafter.name"] == "dgr2"
    assert spec.tags["verifier.model_version"] == str(by_stage["ar_rl"].version) and spec.tags["drafter.model_version"] == str(by_stage["rl"].version)
    assert spec.tags["checkpoint_md5"] == f"{by_stage['ar_rl'].tags['checkpoint_md5']}+{by_stage['rl'].tags['checkpoint_md5']}"
    assert "eval.test.equal_to_gr2_rate" in spec.tags and "speed.tau_none.bs_1.speedup" in spec.tags
    assert smoke_run["second"][-1]["registered"] == {"model": "spec-gr2", "version": str(spec.version), "created": False}
    described = client.get_model_version_by_alias("gr2", "challenger").description
    assert described.startswith("gr2 made by stage `ar_rl`") and "Evaluation (test" in described, described
    assert client.get_registered_model("diffusion-gr2").description.startswith("Diffusion-GR2")

    model = mlflow.pyfunc.load_model("models:/gr2-retriever@challenger")
    out = model.predict(pd.DataFrame({"history": [[1, 2, 3], [10]]}))
    assert len(out) == 2
    for hist, cands in zip([[1, 2, 3], [10]], out["candidates"], strict=True):
        assert len(cands) == 10 and not set(hist) & set(cands)


@pytest.mark.parametrize("name", ["gr2", "diffusion-gr2"])
def test_registered_reranker_reranks(smoke_run: dict[str, Any], name: str) -> None:
    import mlflow.pyfunc
    import pandas as pd

    _mlflow(smoke_run["ws"])
    model = mlflow.pyfunc.load_model(f"models:/{name}@challenger")
    candidates = list(range(20, 30))
    n_evidence = len(json.loads((smoke_run["ws"] / "data/traces/format.json").read_text())["evidence"])
    # The request carries each candidate's evidence levels when the model's prompts do.
    row = {"history": [[1, 2, 3]], "candidates": [candidates]} | ({"evidence": [[[k % 8] * n_evidence for k in range(10)]]} if n_evidence else {})
    out = model.predict(pd.DataFrame(row), params={"max_new_tokens": 64})
    assert sorted(out["ranking"][0]) == candidates  # a permutation, even when the raw answer is invalid
    assert isinstance(bool(out["valid"][0]), bool) and isinstance(out["response"][0], str)


def test_stage_figures_on_their_runs_and_prefect_artifacts(smoke_run: dict[str, Any]) -> None:
    """Each training stage's run holds its figures; each task run is named after its stage; the report is published."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, TaskRunFilter, TaskRunFilterName

    ws = smoke_run["ws"]
    client = _mlflow(ws)
    ran = {s["stage"]: s for s in smoke_run["first"]}
    for stage in ("retrieve", "sft", "ar_rl", "cft", "opd", "rl"):
        logged = sorted(a.path for a in client.list_artifacts(ran[stage]["run_id"], "figures"))
        assert f"figures/{stage}_training_curves.png" in logged and logged == sorted(ran[stage]["figures"])
    assert "figures/retrieve_full_ranking_test.png" in ran["retrieve"]["figures"]
    assert {"figures/evaluate_ablation_test.png", "figures/evaluate_ablation_valid.png"} <= set(ran["evaluate"]["figures"])
    assert ran["prepare"]["figures"] == []
    stages = list(ran)
    with get_client(sync_client=True) as prefect:
        names = {t.name for t in prefect.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=stages)))}
        assert set(stages) <= names
        by_key = {}
        for key in ("gr2-report", "gr2-report-html", "stage-ar-rl"):
            found = prefect.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
            by_key[key] = found
    report_md = [a.data for a in by_key["gr2-report"]]
    assert any("| evaluate | ran |" in md and "### Ablation (test)" in md and str(ws / "reports/index.html") in md for md in report_md)
    assert any((ws / "reports/index.html").as_uri() in str(a.data) for a in by_key["gr2-report-html"])
    stage_md = [a.data for a in by_key["stage-ar-rl"]]
    assert any(md.startswith("### ar_rl: ran in ") and "reward " in md for md in stage_md)
    assert any(md.startswith("### ar_rl: skipped (up to date)") for md in stage_md)  # the second run's


@pytest.mark.slow
def test_gr2_run_console_as_a_user_sees_it(smoke_run: dict[str, Any], tmp_path: Path) -> None:
    """`gr2 run` on a copy of the smoke workspace, console not a terminal: one start and one end line per stage,
    no tool chatter, no live-line control codes; the stage's output and progress bars are in the log file."""
    import os

    from test_schedule import _copy_workspace

    ws = _copy_workspace(smoke_run["ws"], tmp_path / "ws")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "OMP_NUM_THREADS": "1", "GR2_TRACKING": "on"}
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "--stage", "retrieve", "--force"], cwd=ws, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    stage_lines = [line for line in console if line.startswith("[")]
    assert [line.split(" ")[:2] for line in stage_lines] == [["[1/2]", "prepare"]] * 2 + [["[2/2]", "retrieve"]] * 2
    assert stage_lines[0] == "[1/2] prepare ..." and stage_lines[1].startswith("[1/2] prepare ran in ")
    assert stage_lines[3].startswith("[2/2] retrieve ran in ") and "R@10 " in stage_lines[3]
    text = proc.stdout + proc.stderr
    for chatter in ("httpx", "HTTP Request", "Registered model", "Created version", "%|", "\r", "\x1b["):
        assert chatter not in text
    log = next((ws / "logs").glob("*.log")).read_text()
    assert "[retrieve]" in log and "%|" in log  # the stage's output and some of its bars


@pytest.mark.slow  # ~35 s on the smoke fixture (a Prefect API of its own, prepare, part of retrieve)
def test_ctrl_c_stops_gr2_run_cleanly(smoke_run: dict[str, Any], tmp_path: Path) -> None:
    """A Ctrl-C during a stage, as a terminal sends it (SIGINT to the whole process group):
    the stage stops and is not retried, its MLflow run and the pipeline's end KILLED,
    the console says how to go on without a traceback or Prefect's connection errors,
    and no process of the command is left (the temporary API included)."""
    import os
    import signal
    import time

    from test_schedule import _copy_workspace

    ws = _copy_workspace(smoke_run["ws"], tmp_path / "ws")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "OMP_NUM_THREADS": "1", "GR2_TRACKING": "on"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "run", "--stage", "retrieve", "--force"], cwd=ws, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # A terminal's foreground group, with Ctrl-C's default action (a background job ignores it).
        start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("[2/2] retrieve ..."):
                break
        assert seen and seen[-1].startswith("[2/2] retrieve"), "".join(seen)
        time.sleep(2.0)  # the stage is training (the smoke retrieve takes ~7 s)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    console = "".join(seen) + err + out
    assert proc.returncode == 130, console[-3000:]
    assert "[2/2] retrieve FAILED" in console and "interrupted: " in console and "gr2 run" in console
    for noise in ("Traceback", "EventsWorker", "connection attempts failed", "retry"):
        assert noise not in console, console[-3000:]
    time.sleep(1.0)
    with pytest.raises(ProcessLookupError):  # nothing of the command's session is left
        os.killpg(proc.pid, 0)
    client = _mlflow(ws)
    runs = client.search_runs([client.get_experiment_by_name("diffusion-gr2").experiment_id], order_by=["attributes.start_time DESC"], max_results=3)
    by_name = {r.info.run_name: r.info.status for r in runs}
    assert by_name.get("retrieve") == "KILLED" and by_name.get("pipeline") == "KILLED", by_name
