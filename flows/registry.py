"""Registering model stages in the MLflow registry, once per distinct checkpoint.

A registered version is an MLflow pyfunc model (a PythonModel around the
checkpoint folder, logged as an artifact, with explicit pip requirements: both
measured to be the robust and fast choice with transformers 5, see
shared/notes/STACK.md), tagged with its stage and lineage, and given the alias
`challenger`. The same checkpoint hash is never registered twice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlflow
import mlflow.pyfunc
import pandas as pd
from mlflow import MlflowClient

log = logging.getLogger("flows.registry")

CHALLENGER = "challenger"


@dataclass(frozen=True)
class ModelStage:
    """A stage whose output is a registered model."""

    stage: str
    model_name: str
    checkpoint: str  # path relative to the project root, a DVC output of the stage
    # Other files the served model needs (name -> path relative to the root).
    extra_artifacts: tuple[tuple[str, str], ...] = ()


_RERANKER_FILES = (("items", "data/prepared/items.parquet"), ("format", "data/traces/format.json"))
MODEL_STAGES: dict[str, ModelStage] = {
    "retrieve": ModelStage("retrieve", "gr2-retriever", "checkpoints/retriever"),
    "sft": ModelStage("sft", "gr2", "checkpoints/gr2-sft", _RERANKER_FILES),
    "ar_rl": ModelStage("ar_rl", "gr2", "checkpoints/gr2", _RERANKER_FILES),
    "cft": ModelStage("cft", "diffusion-gr2", "checkpoints/dgr2-cft", _RERANKER_FILES),
}


class RetrieverModel(mlflow.pyfunc.PythonModel):
    """Serves the pre-ranker: input rows with `history` (list of item ids), output the top-K items.

    Input: a DataFrame with a column `history` (list[int], oldest first) and
    optionally `k`. Output: a DataFrame with `candidates` (list[int], best first)
    and `scores` (list[float]).
    """

    def load_context(self, context: Any) -> None:
        from gr2model.retriever import load_retriever

        self.scorer, self.spec = load_retriever(Path(context.artifacts["checkpoint"]))

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        from gr2model.scoring import top_k

        histories = [list(map(int, h)) for h in model_input["history"]]
        bad = [i for i, h in enumerate(histories) if any(x < 1 or x > self.spec.num_items for x in h)]
        if bad:
            raise ValueError(f"rows {bad}: item ids must be in 1..{self.spec.num_items}")
        k = int((params or {}).get("k", self.spec.k))
        ids, scores = top_k(self.scorer, histories, k)
        return pd.DataFrame({"candidates": ids.tolist(), "scores": scores.tolist()})


class GR2Model(mlflow.pyfunc.PythonModel):
    """Serves a re-ranker, AR or block diffusion: input `history` and `candidates` (item-id lists), output the ranking.

    A block-diffusion checkpoint decodes with the threshold decoder at the
    params' `tau` (default 0.9), an AR one with the KV-cache AR loop.

    Output columns: `ranking` (the parsed ranking, or the incoming order when the
    answer was invalid), `explanation`, `valid` (whether the raw answer was a
    valid permutation of the candidates), `response` (the raw text).
    """

    def load_context(self, context: Any) -> None:
        import json

        import polars as pl

        from gr2model.checkpoint import load_hf_checkpoint
        from gr2model.rerank_format import FormatConfig, ItemText

        self.model, self.tok = load_hf_checkpoint(Path(context.artifacts["checkpoint"]))
        self.items = ItemText(pl.read_parquet(context.artifacts["items"]))
        self.fmt = FormatConfig(**json.loads(Path(context.artifacts["format"]).read_text()))

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        import polars as pl

        from gr2model.rerank_eval import decoder_kwargs, lm_rerank

        lists = pl.DataFrame(
            {"history": [list(map(int, h)) for h in model_input["history"]], "candidates": [list(map(int, c)) for c in model_input["candidates"]]},
            schema={"history": pl.List(pl.Int64), "candidates": pl.List(pl.Int64)},
        )
        params = params or {}
        kwargs = decoder_kwargs(self.model, float(params.get("tau", 0.9)))
        out = lm_rerank(self.model, self.tok, lists, self.items, self.fmt, max_new_tokens=int(params.get("max_new_tokens", 320)), **kwargs)
        return pd.DataFrame(
            {
                "ranking": [p.ranking for p in out.parsed],
                "explanation": [p.explanation for p in out.parsed],
                "valid": [p.valid_permutation for p in out.parsed],
                "response": out.texts,
            }
        )


PYFUNC_CLASSES: dict[str, type[mlflow.pyfunc.PythonModel]] = {"gr2-retriever": RetrieverModel, "gr2": GR2Model, "diffusion-gr2": GR2Model}


def pip_requirements() -> list[str]:
    """Explicit requirements (inferring them costs seconds and guesses)."""
    pkgs = ["torch", "transformers", "tokenizers", "numpy", "polars", "pandas", "scipy", "safetensors", "tqdm", "mlflow"]
    return [f"{p}=={version(p)}" for p in pkgs] + ["diffusion-gr2"]


def find_version(client: MlflowClient, model_name: str, checkpoint_md5: str) -> Any | None:
    """The registered version made from this checkpoint hash, if any."""
    found = client.search_model_versions(f"name = '{model_name}' and tag.checkpoint_md5 = '{checkpoint_md5}'")
    return found[0] if found else None


def register_checkpoint(
    spec: ModelStage,
    root: Path,
    checkpoint_md5: str,
    run_id: str,
    tags: dict[str, str],
) -> tuple[str, bool]:
    """Register `spec.checkpoint` as a new version of `spec.model_name` unless its hash already is.

    Returns (version, created). A new version gets the tags, the stage tag and the
    alias `challenger`.
    """
    client = MlflowClient()
    existing = find_version(client, spec.model_name, checkpoint_md5)
    if existing is not None:
        log.info("%s: checkpoint %s is already version %s; not registering again", spec.model_name, checkpoint_md5, existing.version)
        return str(existing.version), False
    with mlflow.start_run(run_id=run_id):
        info = mlflow.pyfunc.log_model(
            name=spec.stage,
            python_model=PYFUNC_CLASSES[spec.model_name](),
            artifacts={"checkpoint": str(root / spec.checkpoint), **{name: str(root / path) for name, path in spec.extra_artifacts}},
            pip_requirements=pip_requirements(),
            registered_model_name=spec.model_name,
        )
    mv = info.registered_model_version
    all_tags = {**tags, "stage": spec.stage, "checkpoint_md5": checkpoint_md5, "run_id": run_id}
    for key, value in all_tags.items():
        client.set_model_version_tag(spec.model_name, str(mv), key, str(value))
    client.set_registered_model_alias(spec.model_name, CHALLENGER, str(mv))
    log.info("registered %s version %s (alias %s)", spec.model_name, mv, CHALLENGER)
    return str(mv), True
