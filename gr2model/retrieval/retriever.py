"""The pre-ranker checkpoint: SASRec plus the transition model, as one loadable folder.

Layout of a checkpoint folder:

    sasrec/                   SASRec weights and config (gr2model.retrieval.sasrec.save_sasrec)
    transition_train.parquet  the training sequences the transition counts come from
    retriever.json            RetrieverSpec: catalogue size, K, the ensemble weight, the stage config
    COMPLETE                  written last; a folder without it is never loaded

The transition model is stored as the sequences it counts rather than as a
matrix: it is rebuilt exactly (counting is deterministic) in about a second, and
the file doubles as the record of what the pre-ranker was trained on.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from gr2model.retrieval.baselines import EnsembleScorer, TransitionScorer
from gr2model.retrieval.sasrec import SASRec, SASRecScorer, load_sasrec, save_sasrec

MARKER = "COMPLETE"


@dataclass(frozen=True)
class RetrieverSpec:
    num_items: int
    k: int
    transition_weight: float
    transition: dict[str, Any] = field(default_factory=dict)
    stage_config: dict[str, Any] = field(default_factory=dict)


def save_retriever(out_dir: Path, sasrec: SASRec, train_sequences: list[list[int]], spec: RetrieverSpec) -> None:
    """Write a complete checkpoint into `out_dir` (the caller makes it atomic)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_sasrec(sasrec, out_dir / "sasrec")
    pl.DataFrame({"train": train_sequences}, schema={"train": pl.List(pl.Int64)}).write_parquet(out_dir / "transition_train.parquet")
    (out_dir / "retriever.json").write_text(json.dumps(asdict(spec), indent=2))
    (out_dir / MARKER).write_text("ok\n")


def load_retriever(ckpt_dir: Path) -> tuple[EnsembleScorer, RetrieverSpec]:
    """The pre-ranker as a Scorer (SASRec log-probabilities + weight * transition log-scores)."""
    if not (ckpt_dir / MARKER).exists():
        raise FileNotFoundError(f"{ckpt_dir}: not a complete retriever checkpoint (no {MARKER} marker)")
    spec = RetrieverSpec(**json.loads((ckpt_dir / "retriever.json").read_text()))
    train = pl.read_parquet(ckpt_dir / "transition_train.parquet")["train"].to_list()
    transition = TransitionScorer(train, spec.num_items, **spec.transition)
    scorer = EnsembleScorer([SASRecScorer(load_sasrec(ckpt_dir / "sasrec")), transition], [1.0, spec.transition_weight])
    return scorer, spec
