"""Stage `retrieve`: train the pre-ranker and write the top-K candidate lists in its order.

The pre-ranker is SASRec (full-softmax cross-entropy, early stopping on
validation) added to a first-order item-transition model with a weight chosen on
validation; popularity and the transition model alone are computed by the same
code as baselines. Candidate lists for training examples are cross-fitted over
user folds, so no list comes from a model trained on that example's target.

Resumable (README "Resuming a killed stage"): each SASRec training run saves its
state as params.yaml `resume:` says, under its own loop name (`sasrec` for the
final model, `fold<f>` for the cross-fitted ones); a killed stage rerun with the
same params and inputs skips the runs that finished and continues the one that
was cut, ending with the outputs of an uninterrupted run.

    python -m tasks.retrieve           # reads the `retrieve` section of params.yaml
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import polars as pl
import torch
from pydantic import Field, ValidationInfo, field_validator

from gr2model.retrieval.baselines import EnsembleScorer, PopularityScorer, TransitionScorer, tune_weight
from gr2model.data.candidates import (
    candidate_lists,
    crossfit_candidate_lists,
    eval_examples,
    rerank_metrics,
    training_positions,
    write_parquet_atomic,
)
from gr2model.data.dataset import load_prepared
from gr2model.retrieval.retriever import RetrieverSpec, save_retriever
from gr2model.retrieval.sasrec import SASRecConfig, SASRecScorer, SASRecTrainConfig, train_sasrec
from gr2model.retrieval.scoring import Scorer, evaluate_full_ranking
from gr2model.task.rerank_format import MAX_POSITIONS
from tasks.common import Cap, Count, NonNegative, Positive, Seed, StageConfig, StageResume, atomic_dir, stage_main, timed
from tasks.tracking import StageTracker

STAGE = "retrieve"
PREPARED = Path("data/prepared")
CHECKPOINT = Path("checkpoints/retriever")
CANDIDATES = Path("data/candidates")
METRICS = Path("metrics/retrieve.json")


# (0, 1]: a decay of 0 would silence every item but the first (gr2model.retrieval.baselines.TransitionScorer).
Decay = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]


class SASRecParams(StageConfig):
    max_len: Count = 50
    hidden: Count = 64
    heads: Count = 2
    layers: Count = 2
    dropout: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] = 0.2  # 1 would zero every activation

    @field_validator("heads")
    @classmethod
    def _heads_divide_hidden(cls, heads: int, info: ValidationInfo) -> int:
        # Checked here, not when the model is built, so the error comes before any work.
        hidden = info.data.get("hidden")
        if hidden is not None and hidden % heads:
            raise ValueError(f"{heads} heads do not divide hidden {hidden}")
        return heads


class TrainParams(StageConfig):
    epochs: Count = 200
    batch_size: Count = 128
    lr: Positive = 1e-3
    weight_decay: NonNegative = 0.0
    patience: Count = 5
    num_negatives: Cap = 0  # 0 = full softmax
    eval_every: Count = 1
    max_valid_users: Cap = 0  # 0 = all


class TransitionParams(StageConfig):
    """First-order transitions; defaults tuned on validation NDCG@10 (gr2model.retrieval.baselines.TransitionScorer)."""

    last_n: Count = 10
    decay: Decay = 0.6
    window: Count = 10
    window_decay: Decay = 0.8
    smoothing: Positive = 75.0  # > 0 keeps every score finite


class RetrieveConfig(StageConfig):
    seed: Seed = 0
    # At least 2 (one candidate leaves nothing to re-rank); at most the <pos_k> tokens of the vocabulary.
    k: Annotated[int, Field(ge=2, le=MAX_POSITIONS)] = 10
    sasrec: SASRecParams = SASRecParams()
    train: TrainParams = TrainParams()
    transition: TransitionParams = TransitionParams()
    # Weights of the transition model added to SASRec's log-probabilities, tried on validation.
    ensemble_grid: Annotated[list[NonNegative], Field(min_length=1)] = [0.0, 0.25, 0.5, 1.0, 2.0]
    crossfit_folds: Annotated[int, Field(ge=2)] = 3  # cross-fitting needs two folds
    min_history: Count = 1  # an empty history has nothing to score candidates from
    train_positions_per_user: Cap = 0  # 0 = every position
    eval_chunk_size: Count = 2048


CONFIG = RetrieveConfig


def _histories(df: pl.DataFrame) -> tuple[list[list[int]], np.ndarray]:
    return df["history"].to_list(), df["target"].to_numpy()


class PreRanker:
    """Fits the whole pre-ranker (SASRec + transitions) on a set of training sequences.

    With `resume`, fold f's SASRec run saves and resumes its state as loop `fold<f>`.
    """

    def __init__(self, cfg: RetrieveConfig, num_items: int, weight: float, epochs: int, resume: StageResume | None = None):
        self.cfg, self.num_items, self.weight, self.epochs = cfg, num_items, weight, epochs
        self.resume = resume

    def __call__(self, train_sequences: list[list[int]], fold: int) -> Scorer:
        tcfg = SASRecTrainConfig(**{**self.cfg.train.model_dump(), "epochs": self.epochs, "seed": self.cfg.seed + 1 + fold})
        result = train_sasrec(
            train_sequences,
            SASRecConfig(num_items=self.num_items, **self.cfg.sasrec.model_dump()),
            tcfg,
            checkpointer=self.resume.checkpointer(f"fold{fold}") if self.resume else None,
        )
        transition = TransitionScorer(train_sequences, self.num_items, **self.cfg.transition.model_dump())
        return EnsembleScorer([SASRecScorer(result.model), transition], [1.0, self.weight])


def run(
    cfg: RetrieveConfig, root: Path, log: logging.Logger, tracker: StageTracker, resume: StageResume | None = None
) -> dict[str, Any]:
    """Train, evaluate and write the pre-ranker and its candidate lists; returns the stage metrics.

    resume: where the SASRec runs save their states (loops `sasrec`, `fold<f>`); None: no saves.
    """
    torch.manual_seed(cfg.seed)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    ds, split = load_prepared(root / PREPARED)
    num_items = ds.num_items
    train_seqs: list[list[int]] = split["train"].to_list()
    evals = {name: eval_examples(split, name) for name in ("valid", "test")}
    log.info("%d users, %d items, %d training interactions", split.height, num_items, sum(map(len, train_seqs)))

    def full(scorer: Scorer, name: str) -> dict[str, dict[str, float]]:
        return {
            split_name: evaluate_full_ranking(scorer, *_histories(df), ks=(5, 10), chunk_size=cfg.eval_chunk_size, desc=f"{name} {split_name}")
            for split_name, df in evals.items()
        }

    full_ranking: dict[str, dict[str, dict[str, float]]] = {}
    with timed(log, "baselines: popularity and transitions", timings, "baselines_s"):
        popularity = PopularityScorer(train_seqs, num_items)
        transition = TransitionScorer(train_seqs, num_items, **cfg.transition.model_dump())
        full_ranking["popularity"] = full(popularity, "popularity")
        full_ranking["transition"] = full(transition, "transition")

    with timed(log, "train SASRec (early stopping on validation)", timings, "sasrec_train_s"):
        sas_cfg = SASRecConfig(num_items=num_items, **cfg.sasrec.model_dump())
        result = train_sasrec(
            train_seqs,
            sas_cfg,
            SASRecTrainConfig(**cfg.train.model_dump(), seed=cfg.seed),
            valid=_histories(evals["valid"]),
            on_epoch=lambda m: tracker.log_metrics({f"sasrec.{k}": v for k, v in m.items() if k != "epoch"}, step=int(m["epoch"])),
            checkpointer=resume.checkpointer("sasrec") if resume else None,
        )
    sasrec = SASRecScorer(result.model)
    full_ranking["sasrec"] = full(sasrec, "sasrec")

    with timed(log, "tune the transition weight on validation", timings, "ensemble_tune_s"):
        weight, table = tune_weight(sasrec, transition, *_histories(evals["valid"]), cfg.ensemble_grid, chunk_size=cfg.eval_chunk_size)
    for w, m in table.items():
        log.info("transition weight %.2f: valid ndcg@10 %.4f recall@10 %.4f", w, m["ndcg@10"], m["recall@10"])
    prerank = EnsembleScorer([sasrec, transition], [1.0, weight])
    full_ranking["prerank"] = full(prerank, "prerank")

    with timed(log, f"candidate lists (K={cfg.k}) for validation and test", timings, "candidates_eval_s"):
        lists = {name: candidate_lists(prerank, df, cfg.k, chunk_size=cfg.eval_chunk_size, desc=f"candidates {name}") for name, df in evals.items()}
    with timed(log, f"cross-fitted candidate lists for training examples ({cfg.crossfit_folds} folds)", timings, "candidates_train_s"):
        train_examples = training_positions(split, min_history=cfg.min_history, positions_per_user=cfg.train_positions_per_user)
        lists["train"] = crossfit_candidate_lists(
            train_examples,
            split,
            PreRanker(cfg, num_items, weight, epochs=result.best_epoch, resume=resume),
            cfg.crossfit_folds,
            cfg.k,
            seed=cfg.seed,
        )

    with timed(log, "write candidate lists and checkpoint", timings, "write_s"):
        with atomic_dir(root / CANDIDATES) as out:
            for name, df in lists.items():
                write_parquet_atomic(df, out / f"{name}.parquet")
        spec = RetrieverSpec(
            num_items=num_items,
            k=cfg.k,
            transition_weight=weight,
            transition=cfg.transition.model_dump(),
            stage_config=cfg.model_dump(),
        )
        with atomic_dir(root / CHECKPOINT) as out:
            save_retriever(out, result.model, train_seqs, spec)

    metrics: dict[str, Any] = {
        "full_ranking": {
            split_name: {model: full_ranking[model][split_name] for model in full_ranking} for split_name in ("valid", "test")
        },
        "prerank": {
            "components": "sasrec + transition" if weight > 0 else "sasrec",
            "transition_weight": weight,
            "sasrec_best_epoch": result.best_epoch,
            "sasrec_epochs_run": len(result.history),
        },
        "rerank": {name: rerank_metrics(lists[name]) for name in ("train", "valid", "test")},
        "k": cfg.k,
        **timings,
        "seconds": round(time.perf_counter() - start, 2),
    }
    log.info("pre-rank test full ranking: %s", metrics["full_ranking"]["test"]["prerank"])
    log.info("re-ranking examples: %s", {n: metrics["rerank"][n]["n"] for n in metrics["rerank"]})
    return metrics


def main() -> None:
    stage_main(STAGE, CONFIG, run, METRICS, resumable=True)


if __name__ == "__main__":
    main()
