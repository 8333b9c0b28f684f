"""Stage `traces`: the stronger teacher writes reasoning traces for the training re-ranking examples.

The teacher (gr2model.teacher.ExpertTeacher) scores candidates from co-purchase
statistics, shared semantic-id prefixes and attributes and the pre-ranker's
scores; its feature weights are fitted on the training lists. Rejection
sampling (default) keeps a sampled ranking only when it puts the target first;
targeted mode explains a ranking with the target moved first. The prompt format
chosen here is written to `data/traces/format.json` and used by every later stage.

    python -m tasks.traces
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import numpy as np
import polars as pl

from gr2model.candidates import rerank_metrics, write_parquet_atomic
from gr2model.data import load_prepared
from gr2model.rerank_format import FormatConfig, ItemText
from gr2model.teacher import ExpertTeacher, TeacherConfig, generate_traces, teacher_accuracy
from tasks.common import StageConfig, atomic_dir, stage_main, timed
from tasks.tracking import StageTracker

STAGE = "traces"
PREPARED = Path("data/prepared")
CANDIDATES = Path("data/candidates")
OUT_DIR = Path("data/traces")
METRICS = Path("metrics/traces.json")


class TracesConfig(StageConfig):
    mode: Literal["rejection", "targeted"] = "rejection"
    samples: int = 8
    temperature: float = 1.0
    target_tokens: int = 130
    seed: int = 0
    # The prompt format of the whole re-ranker (shared by sft ... evaluate through format.json).
    history_len: int = 10
    with_attributes: bool = True
    max_attributes: int = 3
    max_examples: int = 0  # 0 = every training re-ranking example; >0 keeps the first N (smoke runs)


CONFIG = TracesConfig


def user_folds_from_lists(split: pl.DataFrame, train_lists: pl.DataFrame) -> np.ndarray:
    """(n_users,) the fold each user's training lists were cross-fitted in, aligned with `split`.

    The teacher must leave out the same fold's interactions as the pre-ranker
    that produced a list, or its co-purchase counts contain the list's target.
    Users with no training list get -1 (their interactions count in every fold).
    """
    folds = train_lists.select("user_id", "fold").unique("user_id")
    aligned = split.select("user_id").join(folds, on="user_id", how="left", maintain_order="left")
    return aligned["fold"].fill_null(-1).to_numpy()


def run(cfg: TracesConfig, root: Path, log: logging.Logger, tracker: StageTracker) -> dict[str, Any]:
    """Fit the teacher, write the traces and the format; returns the stage metrics."""
    timings: dict[str, float] = {}
    start = time.perf_counter()
    ds, split = load_prepared(root / PREPARED)
    train = pl.read_parquet(root / CANDIDATES / "train.parquet")
    valid = pl.read_parquet(root / CANDIDATES / "valid.parquet")
    fmt = FormatConfig(history_len=cfg.history_len, with_attributes=cfg.with_attributes, max_attributes=cfg.max_attributes)
    items = ItemText(ds.items)

    with timed(log, "build the teacher and fit its weights on the training lists", timings, "fit_s"):
        teacher = ExpertTeacher(
            ds.items,
            split["train"].to_list(),
            ds.num_items,
            target_tokens=cfg.target_tokens,
            folds=user_folds_from_lists(split, train),
        )
        weights = teacher.fit_weights(train)
    log.info("teacher weights: %s", {k: round(v, 3) for k, v in weights.items()})
    with timed(log, "teacher accuracy on validation (no target knowledge)", timings, "accuracy_s"):
        accuracy = {"teacher": teacher_accuracy(teacher, valid), "prerank": rerank_metrics(valid)}
    log.info("valid R@1 teacher %.4f vs pre-rank %.4f", accuracy["teacher"]["recall@1"], accuracy["prerank"]["recall@1"])

    examples = train.filter(pl.col("target_rank") >= 0)
    if cfg.max_examples:
        examples = examples.head(cfg.max_examples)
    tcfg = TeacherConfig(mode=cfg.mode, samples=cfg.samples, temperature=cfg.temperature, target_tokens=cfg.target_tokens, seed=cfg.seed)
    with timed(log, f"{cfg.mode} traces for {examples.height} training re-ranking examples", timings, "generate_s"):
        traces, stats = generate_traces(teacher, examples, items, fmt, tcfg)

    with atomic_dir(root / OUT_DIR) as out:
        write_parquet_atomic(traces, out / "train.parquet")
        (out / "format.json").write_text(json.dumps(asdict(fmt), indent=2))
        (out / "teacher.json").write_text(json.dumps({"weights": teacher.weights, "evidence_weights": teacher.evidence_weights, "config": asdict(tcfg)}, indent=2))
    tracker.log_metrics({f"teacher_weight.{k}": v for k, v in weights.items()})
    return {
        "mode": cfg.mode,
        **stats,
        "kept": int(traces["kept"].sum()),
        "valid_accuracy": accuracy,
        **timings,
        "seconds": round(time.perf_counter() - start, 2),
    }


def load_format(root: Path) -> FormatConfig:
    """The prompt format the traces were written in (every later stage uses it)."""
    return FormatConfig(**json.loads((root / OUT_DIR / "format.json").read_text()))


def main() -> None:
    stage_main(STAGE, CONFIG, run, METRICS)


if __name__ == "__main__":
    main()
