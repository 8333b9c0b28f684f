"""The speculative re-ranker `spec-gr2` in the registry: bundled, traced to both sources, served, gated.

One toy workspace for the module: GR2 (a random AR model over the toy task's
tokenizer) and a drafter (a block-diffusion model with GR2's tokenizer and
other random weights, so most drafts are rejected and GR2's verification is
what decides every token), registered as `gr2`, `diffusion-gr2` and then
`spec-gr2` in a SQLite store in a temporary folder, through the same functions
the pipeline calls. No server is started: the scoring app is MLflow's own
(`build_app`, what `gr2 serve` and `mlflow models serve` run) behind starlette's
test client. tests/test_serving.py serves the smoke pipeline's champion over real HTTP.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pandas as pd
import polars as pl
import pytest
import yaml

from gr2model.models.block_diffusion import convert_to_block_diffusion
from gr2model.models.checkpoint import save_hf_checkpoint
from gr2model.task.rerank_format import FormatConfig

from tiny import TOY_CANDIDATES, items_table, randomize, toy_model, toy_tokenizer

pytestmark = pytest.mark.integration  # the registry's functions and MLflow's scoring app, for real

GR2_MD5, DRAFTER_MD5 = "9a1b.dir", "d4e5.dir"  # the checkpoints' DVC hashes in the fake dvc.lock
DRAFT_LEN, DRAFT_STEPS = 3, 2
ROWS = pd.DataFrame({"history": [[1], [2, 3], [4], [1, 2]], "candidates": [list(c) for c in TOY_CANDIDATES[:4]]})
PARAMS = {"max_new_tokens": 24}


def _workspace(root: Path) -> None:
    """What `evaluate` leaves: both checkpoints, items, format, candidate lists, dvc.lock, the spec row."""
    tok = toy_tokenizer()
    gr2 = randomize(toy_model(tok), 0.3).eval()
    drafter = randomize(convert_to_block_diffusion(gr2, tok, block_size=4), 0.3, seed=7).eval()
    save_hf_checkpoint(root / "checkpoints/gr2", gr2, tok, {})
    save_hf_checkpoint(root / "checkpoints/dgr2", drafter, tok, {})
    (root / "data/prepared").mkdir(parents=True)
    items_table().write_parquet(root / "data/prepared/items.parquet")
    (root / "data/traces").mkdir(parents=True)
    (root / "data/traces/format.json").write_text(json.dumps(asdict(FormatConfig(history_len=1, with_attributes=False))))
    (root / "data/candidates").mkdir(parents=True)
    pl.DataFrame({"candidates": [list(c) for c in TOY_CANDIDATES]}).write_parquet(root / "data/candidates/test.parquet")
    lock = {
        "schema": "2.0",
        "stages": {
            "evaluate": {
                "cmd": "python -m tasks.evaluate",
                "deps": [{"path": "checkpoints/gr2", "md5": GR2_MD5}, {"path": "checkpoints/dgr2", "md5": DRAFTER_MD5}],
                "params": {"params.yaml": {"evaluate": {"spec_drafter": ["dgr2"]}}},
                "outs": [{"path": "metrics/evaluate.json", "md5": "e"}, {"path": "metrics/speed.json", "md5": "s"}],
            }
        },
    }
    (root / "dvc.lock").write_text(yaml.safe_dump(lock))
    (root / "metrics").mkdir()
    spec_row = {"recall@1": 0.34, "ndcg@3": 0.47, "valid_permutation_rate": 0.999, "equal_to_gr2_rate": 1.0, "n": 2076.0,
                "draft_len": DRAFT_LEN, "draft_steps": DRAFT_STEPS}  # fmt: skip
    (root / "metrics/evaluate.json").write_text(json.dumps({"gr2": {"test": {"recall@1": 0.34}}, "spec-dgr2": {"test": spec_row}}))
    spec = {"decoder": "spec", "model": "dgr2", "tau": None, "sub_block_size": None, "draft_len": DRAFT_LEN, "draft_steps": DRAFT_STEPS}
    rows = [
        {"decoder": "ar", "model": "gr2", "tau": None, "batch_size": 1, "speedup": 1.0},
        {**spec, "batch_size": 1, "speedup": 0.76, "mean_accepted_length": 3.97, "equal_to_gr2": 1.0},
        {**spec, "batch_size": 16, "speedup": 0.33, "mean_accepted_length": 3.9, "equal_to_gr2": 1.0},
    ]
    (root / "metrics/speed.json").write_text(json.dumps({"rows": rows}))


@pytest.fixture(scope="module")
def registered(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The workspace, with gr2 and diffusion-gr2 registered from its checkpoints, then spec-gr2 from the pair."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.tracking._tracking_service import utils as tracking_utils

    from flows.registry import MODEL_STAGES, register_checkpoint, register_speculative, speculative_pairs

    root = tmp_path_factory.mktemp("spec-ws")
    _workspace(root)
    store = f"sqlite:///{root / 'mlflow.db'}"
    # register_* use MLflow's process-wide URI (as the pipeline does); ours for this module, then
    # exactly what was there before (None = unset), so later tests do not write to this store.
    before = tracking_utils._tracking_uri
    mlflow.set_tracking_uri(store)
    try:
        client = MlflowClient(store, store)
        exp = client.create_experiment("spec", artifact_location=(root / "artifacts").as_uri())  # not ./mlruns of the cwd
        runs = {stage: client.create_run(exp, run_name=stage).info.run_id for stage in ("ar_rl", "rl", "evaluate")}
        gr2_v, _ = register_checkpoint(MODEL_STAGES["ar_rl"], root, GR2_MD5, runs["ar_rl"], {})
        dgr2_v, _ = register_checkpoint(MODEL_STAGES["rl"], root, DRAFTER_MD5, runs["rl"], {})
        (pair,) = speculative_pairs(root)
        spec_v, created = register_speculative(pair, root, runs["evaluate"], {"git.commit": "abc"})
        assert created
        load = lambda name: mlflow.pyfunc.load_model(f"models:/{name}@challenger")  # noqa: E731
        yield {
            "root": root, "client": client, "runs": runs, "pair": pair, "versions": {"gr2": gr2_v, "diffusion-gr2": dgr2_v, "spec-gr2": spec_v},
            "spec": load("spec-gr2"), "gr2": load("gr2"), "drafter": load("diffusion-gr2"),
        }  # fmt: skip
    finally:
        mlflow.set_tracking_uri(before)


def test_spec_answers_equal_gr2s_and_the_drafters_do_not(registered: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import gr2model.eval.rerank_eval as rerank_eval

    # That it decodes speculatively (else plain GR2 would pass): the drafter's forwards are counted.
    outputs, draft_lens = [], []

    def counted(*args: Any, **kwargs: Any) -> Any:
        draft_lens.append(kwargs["draft_len"])
        outputs.append(speculative_generate(*args, **kwargs))
        return outputs[-1]

    speculative_generate = rerank_eval.speculative_generate
    monkeypatch.setattr(rerank_eval, "speculative_generate", counted)
    spec = registered["spec"].predict(ROWS, params=PARAMS)
    assert outputs and sum(o.draft_nfe for o in outputs) > 0 and sum(o.ar_nfe for o in outputs) > 0
    assert set(draft_lens) == {DRAFT_LEN}
    gr2 = registered["gr2"].predict(ROWS, params=PARAMS)
    pd.testing.assert_frame_equal(spec, gr2)
    # What the equality rules out: the drafter decoding alone answers otherwise on these rows.
    drafter = registered["drafter"].predict(ROWS, params=PARAMS)
    assert list(drafter["response"]) != list(gr2["response"])
    assert registered["spec"].model_config["draft_len"] == DRAFT_LEN and registered["spec"].model_config["draft_steps"] == DRAFT_STEPS


def test_scoring_app_serves_gr2s_answers_and_refuses_bad_rows(registered: Any) -> None:
    from starlette.testclient import TestClient

    from flows.serving_app import build_app

    client = TestClient(build_app(registered["spec"]))
    records = ROWS.to_dict(orient="records")
    ok = client.post("/invocations", json={"dataframe_records": records, "params": PARAMS})
    assert ok.status_code == 200, ok.text
    served = pd.DataFrame(ok.json()["predictions"])
    gr2 = registered["gr2"].predict(ROWS, params=PARAMS)
    assert served["response"].tolist() == gr2["response"].tolist() and served["ranking"].tolist() == gr2["ranking"].tolist()
    # The request checks are GR2Model's: a bad row gets a 400 naming the row and field.
    bad = client.post("/invocations", json={"dataframe_records": [records[0], {**records[1], "candidates": [1, 2, 99]}]})
    assert bad.status_code == 400 and "row 1: candidates: unknown item ids [99]" in bad.json()["message"], bad.text
    capped = client.post("/invocations", json={"dataframe_records": records[:1], "params": {"max_new_tokens": 5000}})
    assert capped.status_code == 400 and "max_new_tokens must be an integer in 1..1024" in capped.json()["message"]


def test_version_bundles_both_checkpoints_with_lineage_to_both(registered: Any) -> None:
    import mlflow

    from flows.registry import SPEC_MODEL, register_speculative

    client, v, runs = registered["client"], registered["versions"], registered["runs"]
    mv = client.get_model_version(SPEC_MODEL, v["spec-gr2"])
    tags = mv.tags
    assert tags["stage"] == "evaluate" and tags["checkpoint_md5"] == f"{GR2_MD5}+{DRAFTER_MD5}" and tags["run_id"] == runs["evaluate"]
    assert (tags["verifier.model"], tags["verifier.model_version"], tags["verifier.run_id"]) == ("gr2", v["gr2"], runs["ar_rl"])
    assert (tags["drafter.model"], tags["drafter.model_version"], tags["drafter.run_id"]) == ("diffusion-gr2", v["diffusion-gr2"], runs["rl"])
    assert (tags["verifier.checkpoint_md5"], tags["drafter.checkpoint_md5"]) == (GR2_MD5, DRAFTER_MD5)
    assert (tags["drafter.checkpoint"], tags["drafter.name"], tags["draft_len"]) == ("checkpoints/dgr2", "dgr2", str(DRAFT_LEN))
    assert tags["git.commit"] == "abc"
    assert f"gr2 version {v['gr2']} (checkpoints/gr2, DVC md5 {GR2_MD5}" in mv.description
    assert f"diffusion-gr2 version {v['diffusion-gr2']} (checkpoints/dgr2" in mv.description
    assert client.get_registered_model(SPEC_MODEL).description.startswith("GR2 decoded speculatively")
    # The version's files hold both checkpoints' weights, byte for byte.
    local = Path(mlflow.artifacts.download_artifacts(mv.source, tracking_uri=client.tracking_uri))
    bundled = yaml.safe_load((local / "MLmodel").read_text())["flavors"]["python_function"]["artifacts"]
    md5 = lambda p: hashlib.md5(p.read_bytes()).hexdigest()  # noqa: E731
    for artifact, folder in (("checkpoint", "checkpoints/gr2"), ("drafter", "checkpoints/dgr2")):
        assert md5(local / bundled[artifact]["path"] / "model.safetensors") == md5(registered["root"] / folder / "model.safetensors")
    # The same pair again (a rerun of the pipeline): no second version.
    assert register_speculative(registered["pair"], registered["root"], runs["evaluate"], {}) == (v["spec-gr2"], False)
    assert len(client.search_model_versions(f"name = '{SPEC_MODEL}'")) == 1
    # ... unless it drafts otherwise: the drafting settings are part of the version's identity.
    from flows.registry import find_version

    pair = registered["pair"]
    assert find_version(client, SPEC_MODEL, pair.checkpoint_md5, pair.settings).version == mv.version
    assert find_version(client, SPEC_MODEL, pair.checkpoint_md5, {**pair.settings, "draft_steps": str(pair.draft_steps + 1)}) is None
    assert pair.settings["draft_mode"] == "block" == mv.tags["draft_mode"]
    assert find_version(client, SPEC_MODEL, pair.checkpoint_md5, {**pair.settings, "draft_mode": "window"}) is None


def test_evaluation_and_speed_reach_the_version_and_its_gates(registered: Any) -> None:
    from flows.promote import PromoteConfig, SpeedGate, load_promote_config, promote, record_evaluations, speed_tag
    from flows.registry import SPEC_MODEL

    client, root, v = registered["client"], registered["root"], registered["versions"]["spec-gr2"]
    done = record_evaluations(root, client)
    assert {"model": SPEC_MODEL, "version": v, "stage": "evaluate", "tagged": ["eval", "speed"]} in done
    tags = client.get_model_version(SPEC_MODEL, v).tags
    assert float(tags["eval.test.equal_to_gr2_rate"]) == 1.0 and tags["eval.checkpoint_md5"] == f"{GR2_MD5}+{DRAFTER_MD5}"
    assert float(tags[speed_tag(None, 1, "speedup")]) == 0.76 and float(tags[speed_tag(None, 1, "mean_accepted_length")]) == 3.97
    assert "answers token-for-token GR2's on 1.0000 of the examples" in client.get_model_version(SPEC_MODEL, v).description
    # The project's gates: equal on every example passes; 0.76x is short of 1.5x, and the refusal says by how much.
    gates = load_promote_config(Path(__file__).resolve().parents[1]).models[SPEC_MODEL]
    d = promote(SPEC_MODEL, v, root, PromoteConfig(models={SPEC_MODEL: gates}), client=client, refresh=False)
    assert d.status == "refused" and [g.name for g in d.failed] == ["speedup (batch 1)"], d.table()
    assert "speedup (batch 1) 0.7600 < 1.5000 (rule >= 1.5x over AR), short by 0.7400" in d.summary()
    # With a floor it meets, it becomes the champion.
    met = gates.model_copy(update={"speed": SpeedGate(min_speedup=0.5, tau=None, batch_size=1)})
    assert promote(SPEC_MODEL, v, root, PromoteConfig(models={SPEC_MODEL: met}), client=client, refresh=False).promoted
    # Bench rows drafted otherwise than the version serves are not its speed.
    speed = json.loads((root / "metrics/speed.json").read_text())
    for r in speed["rows"]:
        r["draft_len"] = DRAFT_LEN + 1 if r["decoder"] == "spec" else None
    other = root.parent / "other-ws"
    other.mkdir()
    for name in ("dvc.lock", "metrics/evaluate.json"):
        (other / name).parent.mkdir(exist_ok=True)
        (other / name).write_text((root / name).read_text())
    (other / "metrics/speed.json").write_text(json.dumps(speed))
    assert {"model": SPEC_MODEL, "version": v, "stage": "evaluate", "tagged": ["eval"]} in record_evaluations(other, client)


def test_equality_gate_names_the_rate_the_count_and_the_shortfall() -> None:
    from flows.promote import ModelGates, _why, eval_tag, judge

    gates = ModelGates(metrics=[], min_valid_permutation=0.0, min_equal_to_gr2=1.0)
    tags = {eval_tag("test", "valid_permutation_rate"): "1.0", eval_tag("test", "n"): "2000.0"}
    equal = {g.name: g for g in judge({**tags, eval_tag("test", "equal_to_gr2_rate"): "1.0"}, None, gates)}
    assert equal["equal_to_gr2_rate (test)"].passed
    two_differ = judge({**tags, eval_tag("test", "equal_to_gr2_rate"): "0.999"}, None, gates)
    gate = next(g for g in two_differ if g.name == "equal_to_gr2_rate (test)")
    assert not gate.passed and gate.note == "2 of 2000 evaluated examples differ from GR2's answers"
    assert _why(gate) == "equal_to_gr2_rate (test) 0.9990 < 1.0000 (rule >= 1), short by 0.0010; 2 of 2000 evaluated examples differ from GR2's answers"
    missing = next(g for g in judge(tags, None, gates) if g.name == "equal_to_gr2_rate (test)")
    assert not missing.passed and "no tag eval.test.equal_to_gr2_rate" in missing.note
