"""The decoder setting a version is registered to serve is the one it serves (flows.registry.DecoderSetting).

A toy workspace (a random AR model converted to block diffusion, block size 4) with a params.yaml
whose `evaluate` section names the accuracy table's setting (tau 0.8, sub-blocks of 2): registered
as a `diffusion-gr2` version through the pipeline's own function, in a SQLite store in a temporary
folder, then loaded as MLflow loads it to serve. Its answers must be those of the threshold decoder
at exactly that setting, a request cannot decode it otherwise, and the setting is on the version
(tags and the `decoder` artifact) for promotion to match with the measured rows.
"""

from __future__ import annotations

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

from tiny import TOY_CANDIDATES, items_table, randomize, toy_items, toy_model, toy_tokenizer

ROWS = pd.DataFrame({"history": [[1], [2, 3], [4]], "candidates": [list(c) for c in TOY_CANDIDATES[:3]]})
MD5 = "d9.dir"
FMT = FormatConfig(history_len=1, with_attributes=False)


@pytest.fixture(scope="module")
def registered(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import mlflow
    from mlflow import MlflowClient
    from mlflow.tracking._tracking_service import utils as tracking_utils

    from flows.registry import MODEL_STAGES, register_checkpoint

    root = tmp_path_factory.mktemp("decoder-ws")
    tok = toy_tokenizer()
    dgr2 = randomize(convert_to_block_diffusion(toy_model(tok), tok, block_size=4), 0.3, seed=3).eval()
    save_hf_checkpoint(root / "checkpoints/dgr2", dgr2, tok, {})
    (root / "data/prepared").mkdir(parents=True)
    items_table().write_parquet(root / "data/prepared/items.parquet")
    (root / "data/traces").mkdir(parents=True)
    (root / "data/traces/format.json").write_text(json.dumps(asdict(FMT)))
    (root / "data/candidates").mkdir(parents=True)
    pl.DataFrame({"candidates": [list(c) for c in TOY_CANDIDATES]}).write_parquet(root / "data/candidates/test.parquet")
    (root / "params.yaml").write_text(yaml.safe_dump({"evaluate": {"tau": 0.8, "sub_block_size": 2, "sub_block_cache": False, "grammar_rows": True}}))
    store = f"sqlite:///{root / 'mlflow.db'}"
    before = tracking_utils._tracking_uri
    mlflow.set_tracking_uri(store)
    try:
        client = MlflowClient(store, store)
        exp = client.create_experiment("decoder", artifact_location=(root / "artifacts").as_uri())
        run = client.create_run(exp, run_name="rl").info.run_id
        version, created = register_checkpoint(MODEL_STAGES["rl"], root, MD5, run, {})
        assert created
        yield {
            "root": root, "client": client, "run": run, "version": version, "model": dgr2, "tok": tok,
            "served": mlflow.pyfunc.load_model(f"models:/diffusion-gr2/{version}"),
        }  # fmt: skip
    finally:
        mlflow.set_tracking_uri(before)


def test_the_version_records_evaluates_setting(registered: Any) -> None:
    import mlflow

    from flows.registry import DecoderSetting

    client, v = registered["client"], registered["version"]
    mv = client.get_model_version("diffusion-gr2", v)
    want = DecoderSetting(decoder="diffusion", tau=0.8, sub_block_size=2)  # no cache, no grammar, explanation as the answer
    assert DecoderSetting.from_tags(mv.tags) == want
    local = Path(mlflow.artifacts.download_artifacts(mv.source, tracking_uri=client.tracking_uri))
    artifacts = yaml.safe_load((local / "MLmodel").read_text())["flavors"]["python_function"]["artifacts"]
    assert DecoderSetting.model_validate_json((local / artifacts["decoder"]["path"]).read_text()) == want
    assert f"Served with {want.label()}." in mv.description
    # A request without tau gets the version's, not 0.9 (MLflow fills params from the signature's defaults).
    params = {p.name: p.default for p in registered["served"].metadata.get_params_schema().params}
    assert params["tau"] == 0.8


def test_served_answers_are_the_decoders_at_that_setting(registered: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import gr2model.eval.rerank_eval as rerank_eval
    from gr2model.eval.rerank_eval import decoder_kwargs, lm_rerank

    seen: list[dict[str, Any]] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return lm_rerank(*args, **kwargs)

    monkeypatch.setattr(rerank_eval, "lm_rerank", spy)
    out = registered["served"].predict(ROWS, params={"max_new_tokens": 16})
    (kw,) = seen
    assert (kw["threshold"], kw["sub_block_size"], kw["constrained"]) == (0.8, 2, False) and "sub_block_cache" not in kw
    lists = pl.DataFrame({"history": ROWS["history"].tolist(), "candidates": ROWS["candidates"].tolist()})
    model, tok = registered["model"], registered["tok"]
    direct = lm_rerank(model, tok, lists, toy_items(), FMT, max_new_tokens=16, **decoder_kwargs(model, 0.8, sub_block_size=2))
    assert out["response"].tolist() == direct.texts
    whole = lm_rerank(model, tok, lists, toy_items(), FMT, max_new_tokens=16, **decoder_kwargs(model, 0.9))
    assert whole.texts != direct.texts  # what the old pyfunc served (whole blocks at 0.9) differs on these rows


def test_a_request_cannot_decode_it_otherwise(registered: Any) -> None:
    from mlflow.exceptions import MlflowException

    served = registered["served"]
    assert len(served.predict(ROWS, params={"max_new_tokens": 8, "tau": 0.8})) == len(ROWS)  # its own tau: fine
    with pytest.raises(MlflowException, match=r"params: tau 0.5: this version serves tau 0.8 \(diffusion: tau 0.8, sub-blocks of 2"):
        served.predict(ROWS, params={"max_new_tokens": 8, "tau": 0.5})


def test_settings_are_part_of_a_diffusion_versions_identity(registered: Any) -> None:
    from flows.registry import MODEL_STAGES, register_checkpoint

    root, run = registered["root"], registered["run"]
    assert register_checkpoint(MODEL_STAGES["rl"], root, MD5, run, {}) == (registered["version"], False)
    # evaluate's setting changed: the same checkpoint served otherwise is another version, with its own numbers.
    (root / "params.yaml").write_text(yaml.safe_dump({"evaluate": {"tau": 0.8, "sub_block_size": 4}}))
    try:
        other, created = register_checkpoint(MODEL_STAGES["rl"], root, MD5, run, {})
        assert created and other != registered["version"]
        assert registered["client"].get_model_version("diffusion-gr2", other).tags["decoder.sub_block_size"] == "4"
    finally:
        (root / "params.yaml").write_text(yaml.safe_dump({"evaluate": {"tau": 0.8, "sub_block_size": 2}}))


def test_setting_round_trips_and_refuses_what_does_not_apply() -> None:
    from pydantic import ValidationError

    from flows.registry import DecoderSetting, legacy_setting

    for s in (
        DecoderSetting(decoder="ar"),
        DecoderSetting(decoder="diffusion", tau=0.9, sub_block_size=8, sub_block_cache=True, explanation_tau=0.5, explanation_sub_block_size=32, grammar=True),
        DecoderSetting(decoder="spec", draft_len=8, draft_steps=1, draft_mode="window"),
    ):
        assert DecoderSetting.from_tags(s.tags()) == s
    assert DecoderSetting.from_tags({"stage": "rl"}) is None
    assert legacy_setting(True) == DecoderSetting(decoder="diffusion", tau=0.9)
    for bad in ({"decoder": "diffusion"}, {"decoder": "ar", "tau": 0.9}, {"decoder": "spec", "draft_len": 8}, {"decoder": "ar", "sub_block_cache": True}):
        with pytest.raises(ValidationError):
            DecoderSetting(**bad)
    row = {"decoder": "diffusion", "tau": 0.9, "sub_block_size": 8, "sub_block_cache": False, "explanation_tau": None, "explanation_sub_block_size": None}
    s = DecoderSetting(decoder="diffusion", tau=0.9, sub_block_size=8)
    assert s.matches({**row, "grammar": False}) and not s.matches({**row, "grammar": True})
    assert s.matches(row) and not s.matches({**row, "grammar_changed_rate": 0.05})  # rows before the grammar field
    assert not s.matches({**row, "explanation_tau": 0.3, "explanation_sub_block_size": 32}) and not s.matches({**row, "sub_block_size": None})
