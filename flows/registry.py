"""Registering model stages in the MLflow registry, once per distinct checkpoint.

A registered version is an MLflow pyfunc model (a PythonModel around the
checkpoint folder, logged as an artifact, with explicit pip requirements: both
measured to be the robust and fast choice with transformers 5, see
shared/notes/STACK.md), tagged with its stage and lineage, and given the alias
`challenger`. The same checkpoint hash is never registered twice.

`spec-gr2`, the speculative re-ranker (GR2 verifying a diffusion model's
drafts), is the one version made of two checkpoints: registered after
`evaluate` from the pair that stage measured, once per pair of hashes, with
both checkpoints as artifacts and lineage tags to both (`register_speculative`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from collections import Counter
from collections.abc import Callable, Container, Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, Literal

import mlflow
import mlflow.pyfunc
import pandas as pd
from mlflow import MlflowClient
from pydantic import BaseModel

from flows.decoder_setting import DECODER_ARTIFACT, DecoderSetting, evaluate_setting, legacy_setting, same_threshold
from tasks.common import Count, Unit

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
    made_by: str = ""  # what the stage did to make this version, for its description in the registry
    # The kind of decoder its checkpoint serves with (None: not a re-ranker, the retriever).
    decoder: Literal["ar", "diffusion"] | None = None


_RERANKER_FILES = (("items", "data/prepared/items.parquet"), ("format", "data/traces/format.json"))
MODEL_STAGES: dict[str, ModelStage] = {
    "retrieve": ModelStage("retrieve", "gr2-retriever", "checkpoints/retriever", made_by="SASRec trained with full-softmax cross-entropy, blended with item transitions"),
    "sft": ModelStage("sft", "gr2", "checkpoints/gr2-sft", _RERANKER_FILES, "supervised fine-tuning on the teacher's reasoning traces", "ar"),
    "ar_rl": ModelStage("ar_rl", "gr2", "checkpoints/gr2", _RERANKER_FILES, "DAPO with the conditional verifiable reward after SFT: this is GR2", "ar"),
    "cft": ModelStage("cft", "diffusion-gr2", "checkpoints/dgr2-cft", _RERANKER_FILES, "conversion fine-tuning of GR2's weights to block diffusion", "diffusion"),
    "opd": ModelStage("opd", "diffusion-gr2", "checkpoints/dgr2-opd", _RERANKER_FILES, "on-policy distillation from GR2 after CFT", "diffusion"),
    "rl": ModelStage("rl", "diffusion-gr2", "checkpoints/dgr2", _RERANKER_FILES, "trajectory-level DAPO after OPD: this is Diffusion-GR2", "diffusion"),
}
# The registered models' own descriptions (MLflow's registry page shows them first).
MODEL_DESCRIPTIONS: dict[str, str] = {
    "gr2-retriever": (
        "The pre-ranker of the Diffusion-GR2 pipeline: SASRec plus a first-order item-transition model. "
        "Input: rows with `history` (item ids, oldest first); output: the top-K `candidates` and their `scores`."
    ),
    "gr2": (
        "GR2, the autoregressive generative reasoning re-ranker: a small causal LM that writes a short reasoning "
        "trace, then a ranking of the candidates. Input: `history` and `candidates` (item ids); output: `ranking`, "
        "`explanation`, `valid`, `response`."
    ),
    "diffusion-gr2": (
        "Diffusion-GR2: GR2 converted to a block-diffusion decoder that commits several tokens per forward "
        "(threshold decoder, param `tau`), trained by conversion fine-tuning, on-policy distillation and RL. "
        "Same input and output as gr2."
    ),
    "spec-gr2": (
        "GR2 decoded speculatively: a Diffusion-GR2 model drafts several tokens per round and GR2 verifies them in "
        "one forward, keeping only what GR2 itself would write (greedy), so its answers are GR2's, token for token; "
        "only the speed differs. Each version bundles both checkpoints. Same input and output as gr2."
    ),
}


def version_description(
    spec: ModelStage, root: Path, checkpoint_md5: str, evaluation: Mapping[str, Any] | None = None, setting: DecoderSetting | None = None
) -> str:
    """A registered version's description: what it is, which stage made it from which checkpoint,
    the stage's headline metrics and, once `evaluate` measured it, its accuracy on the held-out split.

    evaluation: the version's `{split: metrics}` of metrics/evaluate.json (None before evaluate ran).
    """
    from tasks.report import format_headline, headline_metrics, read_json

    parts = [f"{spec.model_name} made by stage `{spec.stage}`" + (f" ({spec.made_by})" if spec.made_by else "") + "."]
    parts.append(f"Checkpoint {spec.checkpoint}, DVC md5 {checkpoint_md5}.")
    if setting is not None:
        parts.append(f"Served with {setting.label()}.")
    if head := headline_metrics(spec.stage, read_json(root / "metrics" / f"{spec.stage}.json")):
        parts.append(f"Stage metrics: {format_headline(head)}.")
    if sentence := evaluation_sentence(evaluation):
        parts.append(sentence)
    return " ".join(parts)


def evaluation_sentence(evaluation: Mapping[str, Any] | None) -> str:
    """`Evaluation (test, n=...): R@1 ..., ...` from a model's `{split: metrics}` of metrics/evaluate.json
    (the test split, else valid); "" when there is none. Speculative rows add their equality with GR2."""
    split = next((s for s in ("test", "valid") if isinstance((evaluation or {}).get(s), Mapping)), None)
    if not evaluation or not split:
        return ""
    m = evaluation[split]
    bits = []
    if isinstance(m.get("equal_to_gr2_rate"), (int, float)):
        bits.append(f"answers token-for-token GR2's on {m['equal_to_gr2_rate']:.4f} of the examples")
    if isinstance(m.get("recall@1"), (int, float)):
        ci = m.get("recall@1_ci95")
        bits.append(f"R@1 {m['recall@1']:.4f}" + (f" [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else ""))
    if isinstance(d := m.get("recall@1_vs_prerank"), Mapping):
        bits.append(f"R@1 - pre-rank order {d['diff']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]")
    for key, label in (("ndcg@3", "NDCG@3"), ("valid_permutation_rate", "valid permutations")):
        if isinstance(m.get(key), (int, float)):
            bits.append(f"{label} {m[key]:.4f}")
    n = f", n={int(m['n'])}" if isinstance(m.get("n"), (int, float)) else ""
    return f"Evaluation ({split}{n}): " + ", ".join(bits) + "." if bits else ""


class RetrieverModel(mlflow.pyfunc.PythonModel):
    """Serves the pre-ranker: input rows with `history` (list of item ids), output the top-K items.

    Input: a DataFrame with a column `history` (list[int], oldest first) and
    optionally `k`. Output: a DataFrame with `candidates` (list[int], best first)
    and `scores` (list[float]).
    """

    def load_context(self, context: Any) -> None:
        from gr2model.retrieval.retriever import load_retriever

        self.scorer, self.spec = load_retriever(Path(context.artifacts["checkpoint"]))

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        from gr2model.retrieval.scoring import top_k

        histories = [list(map(int, h)) for h in model_input["history"]]
        bad = [i for i, h in enumerate(histories) if any(x < 1 or x > self.spec.num_items for x in h)]
        if bad:
            raise ValueError(f"rows {bad}: item ids must be in 1..{self.spec.num_items}")
        k = int((params or {}).get("k", self.spec.k))
        ids, scores = top_k(self.scorer, histories, k)
        return pd.DataFrame({"candidates": ids.tolist(), "scores": scores.tolist()})


def served_setting(spec: ModelStage, root: Path) -> DecoderSetting | None:
    """The setting a stage's model is registered to serve: GR2's AR loop, or for a diffusion model
    evaluate's accuracy-table setting in `<root>/params.yaml` (the rows its gates read); None for the retriever."""
    from tasks.common import read_params

    if spec.decoder != "diffusion":
        return None if spec.decoder is None else DecoderSetting(decoder="ar")
    path = root / "params.yaml"
    return evaluate_setting(read_params(path).get("evaluate") if path.exists() else None)


def version_setting(tags: Mapping[str, str], spec: ModelStage) -> DecoderSetting | None:
    """The setting a registered version of a stage's model serves: its `decoder.*` tags, else the legacy one."""
    if spec.decoder is None:
        return None
    return DecoderSetting.from_tags(tags) or legacy_setting(spec.decoder == "diffusion")


def load_decoder_setting(path: str | None, is_diffusion: bool) -> DecoderSetting:
    """The served pyfunc's setting: its `decoder` artifact, else (a version before settings) the legacy one."""
    import json

    if not path:
        return legacy_setting(is_diffusion)
    return DecoderSetting.model_validate(json.loads(Path(path).read_text()))


class ServeLimits(BaseModel):
    """Caps on one re-ranking request to a served model (params.yaml `serve:`).

    Stored in each registered version's model_config, so a served version keeps
    the limits it was registered with. A request beyond a cap is answered 400
    (413 for the body, by the `gr2 serve` front: flows/serving_app.py) before
    any decoding, so a client cannot make the server run out of memory.
    """

    model_config = {"extra": "forbid", "frozen": True}

    max_rows: Count = 256
    """Rows (users) per request; decoding memory and time grow with it."""
    max_history: Count = 1000
    """Items in one row's history. Prompts keep only the last `history_len` (format.json);
    a longer history is refused rather than silently cut, so a client bug shows."""
    max_new_tokens: Count = 1024
    """Largest `max_new_tokens` a request may ask for (the default per request stays 320)."""
    max_body_bytes: Count = 4 * 2**20
    """Request body size, checked before the body is read or parsed (HTTP 413)."""

    @classmethod
    def from_model_config(cls, config: Mapping[str, Any] | None) -> ServeLimits:
        """The limits a version was registered with; defaults for versions registered before limits existed."""
        return cls(**{k: v for k, v in (config or {}).items() if k in cls.model_fields})


def load_serve_limits(root: Path) -> ServeLimits:
    """The `serve:` section of `<root>/params.yaml` (defaults where it is absent); errors name the field."""
    from tasks.common import load_stage_config, read_params

    path = root / "params.yaml"
    if not path.exists() or "serve" not in read_params(path):
        return ServeLimits()
    return load_stage_config("serve", ServeLimits, path)


_RERANK_COLUMNS = ("history", "candidates")
# Sent only to a model whose prompt format writes evidence (FormatConfig.evidence).
_OPTIONAL_COLUMNS = ("evidence",)


def _bad_request(problems: list[str]) -> Exception:
    """An error the scoring server answers with HTTP 400 and this message."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
    return MlflowException("invalid re-ranking request: " + "; ".join(shown), error_code=INVALID_PARAMETER_VALUE)


def _as_records(model_input: Any) -> list[dict[str, Any]]:
    """Rows of a DataFrame, a dict of columns, or a list of dicts, as dicts (no value converted)."""
    if isinstance(model_input, pd.DataFrame):
        columns = list(model_input.columns)
        rows = [dict(zip(columns, values, strict=True)) for values in model_input.itertuples(index=False, name=None)]
    elif isinstance(model_input, dict) and model_input:
        columns = list(model_input)
        lengths = {c: len(v) if hasattr(v, "__len__") and not isinstance(v, (str, bytes)) else -1 for c, v in model_input.items()}
        if len(set(lengths.values())) != 1 or -1 in lengths.values():
            raise _bad_request([f"columns must be lists of the same length (one entry per row), got lengths {lengths}"])
        n = next(iter(lengths.values()), 0)
        try:
            rows = [{c: model_input[c][i] for c in columns} for i in range(n)]
        except (KeyError, IndexError, TypeError):  # e.g. {"history": {"a": 1}}: a mapping, not a column
            raise _bad_request([f"columns must be lists (one entry per row), got {', '.join(f'{c}: {type(model_input[c]).__name__}' for c in columns)}"]) from None
    elif isinstance(model_input, (dict, list)) and all(isinstance(r, dict) for r in model_input):  # {} or [] too
        rows = list(model_input) if isinstance(model_input, list) else []
        columns = sorted({c for r in rows for c in r})
    else:
        raise _bad_request([f"expected rows with columns {list(_RERANK_COLUMNS)}, got {type(model_input).__name__}"])
    if not rows:
        raise _bad_request(["no rows: send at least one row with history and candidates"])
    missing = [c for c in _RERANK_COLUMNS if c not in columns]
    unknown = [c for c in columns if c not in _RERANK_COLUMNS + _OPTIONAL_COLUMNS]
    problems = [f"missing column '{c}'" for c in missing] + [
        f"unknown column '{c}' (expected {list(_RERANK_COLUMNS)}, optionally {list(_OPTIONAL_COLUMNS)})" for c in unknown
    ]
    if problems:
        raise _bad_request(problems)
    return rows


def _item_list(value: Any) -> tuple[list[int] | None, str]:
    """(item ids, "") for a list of integers, else (None, what is wrong with the value)."""
    import numpy as np

    if value is None or (isinstance(value, float) and value != value):
        return None, "missing"
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, (list, tuple, np.ndarray)):
        return None, f"must be a list of integer item ids, got {type(value).__name__} {str(value)[:40]!r}"
    out = []
    for x in value:
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
            return None, f"must be a list of integer item ids, got {type(x).__name__} {str(x)[:40]!r}"
        out.append(int(x))
    return out, ""


def validate_rerank_evidence(model_input: Any, candidate_lists: list[list[int]], n_features: int) -> list[list[list[int]]] | None:
    """Check the `evidence` column of a request against the model's prompt format.

    A model whose format writes `n_features` evidence features per candidate
    needs, in each row, one list of n_features integer levels (0..EVIDENCE_LEVELS-1,
    from the thresholds in the model's `format` artifact) per candidate; a model
    without evidence (n_features 0) refuses the column.

    Returns:
        The rows' (K, F) levels, or None for a model without evidence.
    Raises:
        MlflowException (HTTP 400 when served): each problem, naming its row.
    """
    import numpy as np

    from gr2model.task.rerank_format import EVIDENCE_LEVELS

    rows = _as_records(model_input)
    sent = [r.get("evidence") is not None for r in rows]
    if not n_features:
        if any(sent):
            raise _bad_request(["evidence: this model's prompts carry no evidence; drop the column"])
        return None
    problems: list[str] = []
    out: list[list[list[int]]] = []
    for i, (row, cands) in enumerate(zip(rows, candidate_lists, strict=True)):
        ev = row.get("evidence")
        want = f"{len(cands)} lists (one per candidate) of {n_features} integer levels in 0..{EVIDENCE_LEVELS - 1}"
        try:
            arr = np.asarray([list(e) for e in ev], dtype=object) if ev is not None and not isinstance(ev, (str, bytes, dict)) else None
        except (TypeError, ValueError):  # not iterable; or ragged in a way numpy refuses
            arr = None
        ok = arr is not None and arr.shape == (len(cands), n_features) and all(
            isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) and 0 <= x < EVIDENCE_LEVELS for x in arr.flat
        )
        if not ok:
            problems.append(f"row {i}: evidence: {'missing' if ev is None else 'malformed'}; expected {want}")
            out.append([])
        else:
            out.append([[int(x) for x in e] for e in arr.tolist()])
    if problems:
        raise _bad_request(problems)
    return out


def validate_rerank_input(
    model_input: Any, known_items: Container[int], num_candidates: int | None, limits: ServeLimits | None = None
) -> tuple[list[list[int]], list[list[int]]]:
    """Check a re-ranking request before any decoding; return its (histories, candidate lists).

    Every re-ranker's pyfunc (AR and diffusion) calls this first. A request is
    at most `limits.max_rows` rows with `history` (a non-empty list of at most
    `limits.max_history` item ids, oldest first) and `candidates`
    (`num_candidates` distinct item ids, in the incoming order); every id must
    be in `known_items` (the model's `items` artifact).

    Raises:
        MlflowException (INVALID_PARAMETER_VALUE, HTTP 400 when served): every
            problem found, each naming its row and field.
    """
    limits = limits or ServeLimits()
    rows = _as_records(model_input)
    if len(rows) > limits.max_rows:
        raise _bad_request([f"{len(rows)} rows; at most {limits.max_rows} per request"])
    problems: list[str] = []
    histories: list[list[int]] = []
    candidate_lists: list[list[int]] = []
    for i, row in enumerate(rows):
        history, why = _item_list(row.get("history"))
        if history is None:
            problems.append(f"row {i}: history: {why}")
        elif not history:
            problems.append(f"row {i}: history: empty; the model needs at least one item the user interacted with")
        elif len(history) > limits.max_history:
            problems.append(f"row {i}: history: {len(history)} items; at most {limits.max_history} (the prompt reads only the latest ones)")
        elif unknown := sorted({x for x in history if x not in known_items}):
            problems.append(f"row {i}: history: unknown item ids {unknown[:10]} (not in the model's items)")
        candidates, why = _item_list(row.get("candidates"))
        if candidates is None:
            problems.append(f"row {i}: candidates: {why}")
        else:
            if num_candidates is not None and len(candidates) != num_candidates:
                problems.append(f"row {i}: candidates: {len(candidates)} items; the model ranks exactly {num_candidates}")
            elif len(candidates) < 2:
                problems.append(f"row {i}: candidates: {len(candidates)} items; at least 2 are needed to rank")
            # Counter, not list.count: a request with a huge candidate list must not cost O(K^2).
            if dup := sorted(x for x, n in Counter(candidates).items() if n > 1):
                problems.append(f"row {i}: candidates: duplicated item ids {dup}")
            if unknown := sorted({x for x in candidates if x not in known_items}):
                problems.append(f"row {i}: candidates: unknown item ids {unknown[:10]} (not in the model's items)")
        histories.append(history or [])
        candidate_lists.append(candidates or [])
    if problems:
        raise _bad_request(problems)
    return histories, candidate_lists


def rerank_params(params: dict[str, Any] | None, limits: ServeLimits | None = None, setting: DecoderSetting | None = None) -> dict[str, Any]:
    """The decoding params of a re-ranking request, checked: `max_new_tokens` (1..limits.max_new_tokens,
    default 320 or the cap if lower) and `tau` (the diffusion commit threshold, in (0, 1], default 0.9).

    setting: the version's decoder setting. A diffusion version decodes at its own `tau` (the one
    its gates judged), so a request may send that tau or none; another is refused, not served.
    """
    cap = (limits or ServeLimits()).max_new_tokens
    params = dict(params or {})
    problems = [f"params: unknown key '{k}' (expected max_new_tokens, tau)" for k in params if k not in ("max_new_tokens", "tau")]
    max_new = params.get("max_new_tokens", min(320, cap))
    if isinstance(max_new, bool) or not isinstance(max_new, int) or not 1 <= max_new <= cap:
        problems.append(f"params: max_new_tokens must be an integer in 1..{cap}, got {max_new!r}")
    served = setting.tau if setting is not None and setting.decoder == "diffusion" else None
    tau = params.get("tau", 0.9 if served is None else served)
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 < float(tau) <= 1.0:
        problems.append(f"params: tau must be a number in (0, 1], got {tau!r}")
    elif served is not None and not same_threshold(tau, served):
        problems.append(
            f"params: tau {tau!r}: this version serves tau {served:g} ({setting.label()}), the setting its "
            "promotion gates judged; send that tau or none (another setting is another version)"
        )
    if problems:
        raise _bad_request(problems)
    return {"max_new_tokens": int(max_new), "tau": float(tau)}


def reranker_log_kwargs(root: Path, setting: DecoderSetting | None = None) -> dict[str, Any]:
    """`log_model` arguments of a re-ranker besides its artifacts.

    - model_config: the number of candidates it was trained to rank (the length
      of the pre-ranker's lists in data/candidates), which requests must match,
      and the request caps of params.yaml `serve:` (ServeLimits);
    - signature: a params schema only. Without one MLflow drops every inference
      param (max_new_tokens, tau) with a warning; without an input schema the
      rows reach `validate_rerank_input`, whose errors say more than MLflow's
      schema enforcement would.
    """
    import polars as pl
    from mlflow.models import ModelSignature
    from mlflow.types import ParamSchema, ParamSpec

    config: dict[str, Any] = load_serve_limits(root).model_dump()
    path = root / "data/candidates/test.parquet"
    if path.exists():
        lengths = pl.read_parquet(path, columns=["candidates"])["candidates"].list.len()
        if len(lengths):
            config["num_candidates"] = int(lengths.max())
    # MLflow fills a missing param with its default, so the default must be within the cap, and a
    # diffusion version's tau default is its own (any other is refused: `rerank_params`).
    tau = setting.tau if setting is not None and setting.decoder == "diffusion" and setting.tau is not None else 0.9
    params = ParamSchema([ParamSpec("max_new_tokens", "long", min(320, config["max_new_tokens"])), ParamSpec("tau", "double", float(tau))])
    return {"model_config": config, "signature": ModelSignature(inputs=None, outputs=None, params=params)}


class GR2Model(mlflow.pyfunc.PythonModel):
    """Serves a re-ranker, AR or block diffusion: input `history` and `candidates` (item-id lists), output the ranking.

    It decodes with the version's decoder setting (`DecoderSetting`, its `decoder`
    artifact): an AR checkpoint with the KV-cache AR loop, a block-diffusion one with the
    threshold decoder at the setting's tau, sub-blocks and cache, with or without the
    grammar, exactly as the rows its promotion gates read were decoded. A version
    registered before settings were recorded decodes whole blocks at tau 0.9.

    Output columns: `ranking` (the parsed ranking, or the incoming order when the
    answer was invalid), `explanation`, `valid` (whether the raw answer was a
    valid permutation of the candidates), `response` (the raw text).
    """

    def load_context(self, context: Any) -> None:
        import json

        import polars as pl

        from gr2model.models.checkpoint import load_hf_checkpoint
        from gr2model.task.rerank_format import FormatConfig, ItemText

        self.model, self.tok = load_hf_checkpoint(Path(context.artifacts["checkpoint"]))
        self.items = ItemText(pl.read_parquet(context.artifacts["items"]))
        self.fmt = FormatConfig(**json.loads(Path(context.artifacts["format"]).read_text()))
        self.num_candidates = (context.model_config or {}).get("num_candidates")
        self.limits = ServeLimits.from_model_config(context.model_config)
        is_diffusion = getattr(self.model.config, "block_size", None) is not None
        self.setting = load_decoder_setting((context.artifacts or {}).get(DECODER_ARTIFACT), is_diffusion)
        if (self.setting.decoder == "diffusion") != is_diffusion:
            raise ValueError(f"the `checkpoint` artifact is {'a block-diffusion' if is_diffusion else 'an AR'} model; its decoder setting is {self.setting.label()}")
        if self.setting.decoder == "diffusion":
            GR2Model.decoding(self, {})  # a sub-block size the block does not divide fails at load, not at a request

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        import polars as pl

        from gr2model.eval.rerank_eval import lm_rerank

        # Validate everything before decoding: a bad request is a 400 naming the row and field.
        histories, candidates = validate_rerank_input(model_input, self.items, self.num_candidates, self.limits)
        evidence = validate_rerank_evidence(model_input, candidates, len(self.fmt.evidence))
        params = rerank_params(params, self.limits, self.setting)
        lists = pl.DataFrame({"history": histories, "candidates": candidates}, schema={"history": pl.List(pl.Int64), "candidates": pl.List(pl.Int64)})
        if evidence is not None:
            lists = lists.with_columns(pl.Series("evidence", evidence, dtype=pl.List(pl.List(pl.Int8))))
        out = lm_rerank(
            self.model, self.tok, lists, self.items, self.fmt, max_new_tokens=params["max_new_tokens"], constrained=self.setting.grammar,
            **self.decoding(params),
        )  # fmt: skip
        return pd.DataFrame(
            {
                "ranking": [p.ranking for p in out.parsed],
                "explanation": [p.explanation for p in out.parsed],
                "valid": [p.valid_permutation for p in out.parsed],
                "response": out.texts,
            }
        )

    def decoding(self, params: dict[str, Any]) -> dict[str, Any]:
        """The `lm_rerank` decoder arguments: the version's setting (the request's params cannot change it;
        `rerank_params` refuses another tau)."""
        from gr2model.eval.rerank_eval import decoder_kwargs

        s = self.setting
        if s.decoder == "ar":
            return {}
        return decoder_kwargs(
            self.model, float(s.tau), sub_block_size=s.sub_block_size, explanation_threshold=s.explanation_tau,
            explanation_sub_block_size=s.explanation_sub_block_size, sub_block_cache=s.sub_block_cache,
        )  # fmt: skip


class SpeculativeGR2Model(GR2Model):
    """Serves GR2 decoded speculatively: a diffusion model drafts, GR2 verifies (`gr2model.decoding.speculative`, greedy).

    Artifacts: `checkpoint` (GR2, the AR verifier), `drafter` (a block-diffusion
    checkpoint with GR2's tokenizer), `items`, `format`. model_config adds
    `draft_len` (tokens drafted per round), `draft_steps` (drafter forwards
    per round) and `draft_mode` (`gr2model.decoding.speculative.diffusion_drafter`;
    "block" where a version predates it) to the re-rankers' `num_candidates`
    and request caps.

    Requests, checks and output are GR2Model's (the same code). The answers are
    GR2's own, token for token: greedy verification keeps a drafted token only
    where it is GR2's argmax, so the drafter changes the speed, never the
    answer; the request param `tau` is accepted and has no effect.
    """

    def load_context(self, context: Any) -> None:
        from gr2model.models.checkpoint import load_hf_checkpoint

        super().load_context(context)
        config = context.model_config or {}
        missing = [k for k in ("draft_len", "draft_steps") if k not in config]
        if missing:
            raise ValueError(f"model_config lacks {missing}: a speculative re-ranker needs its draft length and steps")
        if getattr(self.model.config, "block_size", None) is not None:
            raise ValueError("the `checkpoint` artifact is a block-diffusion model; the verifier must be GR2, an AR model")
        self.drafter, drafter_tok = load_hf_checkpoint(Path(context.artifacts["drafter"]))
        # Drafted ids are verified as GR2's ids: the two must share one vocabulary.
        if drafter_tok.get_vocab() != self.tok.get_vocab():
            raise ValueError("the drafter's tokenizer differs from GR2's; it must be a diffusion model converted from this GR2")
        self.draft_len, self.draft_steps = int(config["draft_len"]), int(config["draft_steps"])
        self.draft_mode = str(config.get("draft_mode", "block"))  # versions before the window drafter: blocks
        drafting = DecoderSetting(decoder="spec", draft_len=self.draft_len, draft_steps=self.draft_steps, draft_mode=self.draft_mode)
        if self.setting.decoder == "spec" and self.setting != drafting:
            raise ValueError(f"the decoder artifact says {self.setting.label()}, model_config {drafting.label()}")
        self.setting = drafting  # a version before settings were recorded has only its model_config

    def decoding(self, params: dict[str, Any]) -> dict[str, Any]:
        """Speculative decoding; a fresh drafter state per request (the drafter's cache is per call)."""
        from gr2model.eval.rerank_eval import speculative_kwargs

        return speculative_kwargs(self.drafter, self.draft_steps, self.draft_len, self.draft_mode)


PYFUNC_CLASSES: dict[str, type[mlflow.pyfunc.PythonModel]] = {
    "gr2-retriever": RetrieverModel, "gr2": GR2Model, "diffusion-gr2": GR2Model, "spec-gr2": SpeculativeGR2Model,
}  # fmt: skip


def pip_requirements() -> list[str]:
    """Explicit requirements (inferring them costs seconds and guesses)."""
    pkgs = ["torch", "transformers", "tokenizers", "numpy", "polars", "pandas", "scipy", "safetensors", "tqdm", "mlflow"]
    return [f"{p}=={version(p)}" for p in pkgs] + ["diffusion-gr2"]


def find_version(
    client: MlflowClient, model_name: str, checkpoint_md5: str, settings: Mapping[str, str] | None = None
) -> Any | None:
    """The registered version made from this checkpoint hash (and with these setting tags), if any."""
    query = f"name = '{model_name}' and tag.checkpoint_md5 = '{checkpoint_md5}'"
    query += "".join(f" and tag.`{key}` = '{value}'" for key, value in (settings or {}).items())  # keys with dots need backticks
    found = client.search_model_versions(query)
    return found[0] if found else None


def find_versions(client: MlflowClient, model_name: str, checkpoint_md5: str) -> list[Any]:
    """Every registered version made from this checkpoint hash (one per decoder setting it serves), oldest first."""
    found = client.search_model_versions(f"name = '{model_name}' and tag.checkpoint_md5 = '{checkpoint_md5}'")
    return sorted(found, key=lambda mv: int(mv.version))


@contextlib.contextmanager
def mlflow_prints_to_log(logger: logging.Logger) -> Iterator[None]:
    """Log what MLflow prints to stderr meanwhile, at INFO, instead of letting it reach the console.

    MLflow's registry announces itself with bare prints ("Registered model 'gr2'
    already exists. Creating a new version of this model...", "Created version
    '3' of model 'gr2'.": `mlflow.utils.logging_utils.eprint`, which writes to
    whatever `sys.stderr` is at the time), not through a logger, so no handler or
    filter of the quiet console can stop them. The console handler holds the real
    stream, so our own lines still show while stderr is redirected.
    """
    buf = io.StringIO()
    try:
        with contextlib.redirect_stderr(buf):
            yield
    finally:
        for line in buf.getvalue().splitlines():
            if line.strip():
                logger.info("%s", line.rstrip())


def register_checkpoint(
    spec: ModelStage,
    root: Path,
    checkpoint_md5: str,
    run_id: str,
    tags: dict[str, str],
) -> tuple[str, bool]:
    """Register `spec.checkpoint` as a new version of `spec.model_name` unless its hash already is.

    Returns (version, created). A new version gets the tags, the stage tag and the
    alias `challenger`. A re-ranker's version also records the decoder setting it serves
    (`served_setting`: the `decoder` artifact and `decoder.*` tags); for a diffusion model the
    setting is part of its identity with the hash.
    """
    python_model = PYFUNC_CLASSES[spec.model_name]()
    setting = served_setting(spec, root)
    artifacts = {"checkpoint": str(root / spec.checkpoint), **{name: str(root / path) for name, path in spec.extra_artifacts}}
    with tempfile.TemporaryDirectory(prefix="gr2-decoder-") as tmp:
        if setting is not None:
            artifacts[DECODER_ARTIFACT] = _write_setting(setting, Path(tmp))
        return _register(
            spec.model_name,
            spec.stage,
            python_model,
            artifacts,
            reranker_log_kwargs(root, setting) if isinstance(python_model, GR2Model) else {},
            checkpoint_md5,
            run_id,
            {**tags, **(setting.tags() if setting is not None else {})},
            lambda: version_description(spec, root, checkpoint_md5, setting=setting),
            # A diffusion checkpoint served at another setting is another version (its numbers differ).
            settings=setting.tags() if setting is not None and setting.decoder == "diffusion" else None,
        )


def _write_setting(setting: DecoderSetting, folder: Path) -> str:
    """decoder.json in `folder` (the `decoder` artifact: log_model copies it into the version)."""
    path = folder / "decoder.json"
    path.write_text(setting.model_dump_json(indent=2) + "\n")
    return str(path)


def _register(
    model_name: str,
    stage: str,
    python_model: mlflow.pyfunc.PythonModel,
    artifacts: dict[str, str],
    log_kwargs: dict[str, Any],
    checkpoint_md5: str,
    run_id: str,
    tags: dict[str, str],
    description: Callable[[], str],
    settings: Mapping[str, str] | None = None,
) -> tuple[str, bool]:
    """Log `python_model` with `artifacts` to run `run_id` as a new version of `model_name`, unless a version
    with tag checkpoint_md5 = `checkpoint_md5` (and the tags `settings`, also among `tags`) exists; tag it,
    describe it (`description()`), alias it `challenger`.

    Returns (version, created).
    """
    client = MlflowClient()
    existing = find_version(client, model_name, checkpoint_md5, settings)
    if existing is not None:
        log.info("%s: checkpoint %s is already version %s; not registering again", model_name, checkpoint_md5, existing.version)
        return str(existing.version), False
    with mlflow.start_run(run_id=run_id), mlflow_prints_to_log(log):
        info = mlflow.pyfunc.log_model(
            name=stage,
            python_model=python_model,
            artifacts=artifacts,
            pip_requirements=pip_requirements(),
            **log_kwargs,
            registered_model_name=model_name,
        )
    mv = info.registered_model_version
    all_tags = {**tags, "stage": stage, "checkpoint_md5": checkpoint_md5, "run_id": run_id}
    for key, value in all_tags.items():
        client.set_model_version_tag(model_name, str(mv), key, str(value))
    client.update_model_version(model_name, str(mv), description=description())
    if not client.get_registered_model(model_name).description and model_name in MODEL_DESCRIPTIONS:
        client.update_registered_model(model_name, description=MODEL_DESCRIPTIONS[model_name])
    client.set_registered_model_alias(model_name, CHALLENGER, str(mv))
    log.info("registered %s version %s (alias %s)", model_name, mv, CHALLENGER)
    return str(mv), True


# ---------------------------------------------------------------------------
# The speculative re-ranker: GR2 verifying a diffusion model's drafts

SPEC_MODEL = "spec-gr2"
# The stage that measures a (GR2, drafter) pair, its `spec-<drafter>` row (answers equal to GR2's)
# and its bench rows (speed), and after which the pipeline registers the pair.
SPEC_STAGE = "evaluate"
VERIFIER = MODEL_STAGES["ar_rl"]  # GR2: the model whose answers the speculative re-ranker gives


@dataclass(frozen=True)
class SpeculativePair:
    """A speculative re-ranker as `evaluate` measured it: GR2 verifying the drafts of the diffusion model `drafter`."""

    drafter: str  # its name in metrics/evaluate.json (row `spec-<drafter>`) and metrics/speed.json
    drafter_stage: str  # the stage whose checkpoint drafts (a key of MODEL_STAGES)
    verifier_md5: str  # DVC md5 of GR2's checkpoint as evaluate read it (dvc.lock)
    drafter_md5: str
    draft_len: int  # tokens drafted per round
    draft_steps: int  # drafter forwards per round
    draft_mode: str = "block"  # on the drafter's blocks or in a window (gr2model.decoding.speculative.diffusion_drafter)

    @property
    def checkpoint_md5(self) -> str:
        """The version's checkpoints: the pair of hashes."""
        return f"{self.verifier_md5}+{self.drafter_md5}"

    @property
    def setting(self) -> DecoderSetting:
        """The decoder setting the version serves with (`DecoderSetting`, recorded on it)."""
        return DecoderSetting(decoder="spec", draft_len=self.draft_len, draft_steps=self.draft_steps, draft_mode=self.draft_mode)  # type: ignore[arg-type]

    @property
    def settings(self) -> dict[str, str]:
        """The drafting settings the version serves with: with the hashes, its identity (a pair drafting
        otherwise is another version, so a served champion always drafts as it was measured)."""
        return {"draft_len": str(self.draft_len), "draft_steps": str(self.draft_steps), "draft_mode": self.draft_mode}


def speculative_pairs(root: Path) -> list[SpeculativePair]:
    """The pairs behind the `spec-<drafter>` rows of `<root>/metrics/evaluate.json`, hashed as dvc.lock's
    `evaluate` entry read them (both checkpoints are its deps, so the numbers are those checkpoints').

    A row whose drafter has no checkpoint of its own (`dgr2-naive`, converted at
    load time) or whose checkpoints dvc.lock does not hash is skipped, with a log line.
    """
    import json

    from flows import dvc_stages
    from tasks.evaluate import SPEC_PREFIX

    path = root / "metrics" / f"{SPEC_STAGE}.json"
    evaluation = json.loads(path.read_text()) if path.exists() else {}
    deps = dvc_stages.lock_entry(root, SPEC_STAGE)["deps"]
    by_checkpoint_name = {Path(s.checkpoint).name: s for s in MODEL_STAGES.values() if s.model_name == "diffusion-gr2"}
    pairs = []
    for name, by_split in evaluation.items():
        if not name.startswith(SPEC_PREFIX):
            continue
        drafter = name[len(SPEC_PREFIX) :]
        stage = by_checkpoint_name.get(drafter)
        if stage is None:
            log.info("%s: drafter %s has no checkpoint of its own (one of %s); not registered", name, drafter, sorted(by_checkpoint_name))
            continue
        verifier_md5, drafter_md5 = deps.get(VERIFIER.checkpoint), deps.get(stage.checkpoint)
        row = next(iter(by_split.values()), {})
        if not verifier_md5 or not drafter_md5 or "draft_len" not in row:
            log.info("%s: dvc.lock's %s entry hashes no %s and %s, or the row has no draft_len; not registered", name, SPEC_STAGE, VERIFIER.checkpoint, stage.checkpoint)
            continue
        pairs.append(SpeculativePair(
            drafter, stage.stage, verifier_md5, drafter_md5, int(row["draft_len"]), int(row["draft_steps"]),
            str(row.get("draft_mode", "block")),
        ))  # fmt: skip
    return pairs


def speculative_lineage(client: MlflowClient, pair: SpeculativePair) -> dict[str, str]:
    """Tags naming both sources of a speculative version: each checkpoint's path and DVC md5, and the
    registered version (and its run) made from it, `none` when that checkpoint was never registered."""
    drafter = MODEL_STAGES[pair.drafter_stage]
    tags = {}
    for role, spec, md5 in (("verifier", VERIFIER, pair.verifier_md5), ("drafter", drafter, pair.drafter_md5)):
        mv = find_version(client, spec.model_name, md5)
        tags |= {
            f"{role}.checkpoint": spec.checkpoint,
            f"{role}.checkpoint_md5": md5,
            f"{role}.stage": spec.stage,
            f"{role}.model": spec.model_name,
            f"{role}.model_version": str(mv.version) if mv is not None else "none",
            f"{role}.run_id": (mv.run_id or "") if mv is not None else "none",
        }
    return tags | {"drafter.name": pair.drafter, **pair.settings}


def speculative_description(lineage: Mapping[str, str], evaluation: Mapping[str, Any] | None = None) -> str:
    """A speculative version's description: both sources (from its lineage tags), how it drafts, and
    once `evaluate` measured it, its equality with GR2 and its accuracy."""
    parts = [f"{SPEC_MODEL} registered by stage `{SPEC_STAGE}`."]
    for role, what in (("verifier", "verifies and answers"), ("drafter", "drafts")):
        parts.append(
            f"{lineage[f'{role}.model']} version {lineage[f'{role}.model_version']} ({lineage[f'{role}.checkpoint']}, "
            f"DVC md5 {lineage[f'{role}.checkpoint_md5']}, stage `{lineage[f'{role}.stage']}`) {what}."
        )
    where = "in a window after the accepted tokens" if lineage.get("draft_mode") == "window" else "on the drafter's blocks"
    parts.append(f"{lineage['draft_len']} tokens drafted per round in {lineage['draft_steps']} drafter forwards, {where}.")
    if sentence := evaluation_sentence(evaluation):
        parts.append(sentence)
    return " ".join(parts)


def register_speculative(pair: SpeculativePair, root: Path, run_id: str, tags: dict[str, str]) -> tuple[str, bool]:
    """Register GR2 verifying `pair.drafter`'s drafts as a version of `spec-gr2`, unless the pair already is.

    The version bundles both checkpoints (artifacts `checkpoint`: GR2, `drafter`)
    with the items and format GR2 reads, serves with `SpeculativeGR2Model`, keeps
    the request caps of the other re-rankers plus `draft_len` and `draft_steps`
    in its model_config, and is tagged with its lineage to both sources
    (`speculative_lineage`). Returns (version, created).
    """
    lineage = speculative_lineage(MlflowClient(), pair)
    setting = pair.setting
    log_kwargs = reranker_log_kwargs(root, setting)
    log_kwargs["model_config"] |= {"draft_len": pair.draft_len, "draft_steps": pair.draft_steps, "draft_mode": pair.draft_mode}
    with tempfile.TemporaryDirectory(prefix="gr2-decoder-") as tmp:
        return _register(
            SPEC_MODEL,
            SPEC_STAGE,
            SpeculativeGR2Model(),
            {
                "checkpoint": str(root / VERIFIER.checkpoint),
                "drafter": str(root / MODEL_STAGES[pair.drafter_stage].checkpoint),
                **{name: str(root / path) for name, path in VERIFIER.extra_artifacts},
                DECODER_ARTIFACT: _write_setting(setting, Path(tmp)),
            },
            log_kwargs,
            pair.checkpoint_md5,
            run_id,
            {**tags, **lineage, **setting.tags()},
            lambda: speculative_description(lineage),
            settings=pair.settings,
        )
