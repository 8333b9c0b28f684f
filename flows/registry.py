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


MODEL_STAGES: dict[str, ModelStage] = {
    "retrieve": ModelStage("retrieve", "gr2-retriever", "checkpoints/retriever"),
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


PYFUNC_CLASSES: dict[str, type[mlflow.pyfunc.PythonModel]] = {"gr2-retriever": RetrieverModel}


def pip_requirements() -> list[str]:
    """Explicit requirements (inferring them costs seconds and guesses)."""
    pkgs = ["torch", "numpy", "polars", "pandas", "scipy", "safetensors", "tqdm", "mlflow"]
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
            artifacts={"checkpoint": str(root / spec.checkpoint)},
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
