"""Stage `prepare`: interactions, item attributes and semantic ids -> leave-one-out tables.

Reads either the sequence format of the shared data set (`Beauty.txt` plus JSON
side files) or the raw Amazon review dump (k-core filtered here), builds semantic
ids when none are given, splits leave-one-out, and writes `data/prepared/` and
`metrics/prepare.json`.

    python -m tasks.prepare            # reads the `prepare` section of params.yaml
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import polars as pl
from pydantic import Field

from gr2model.data.dataset import (
    DataError,
    Dataset,
    detect_format,
    leave_one_out,
    load_raw_reviews,
    load_sequence_dataset,
    raw_reviews_files,
    save_prepared,
)
from gr2model.task.rerank_format import SID_LEVELS
from gr2model.data.semantic_ids import build_semantic_ids, prefix_unique_share
from tasks.common import Cap, Count, Seed, StageConfig, stage_main, timed
from tasks.tracking import StageTracker

STAGE = "prepare"
OUT_DIR = Path("data/prepared")
METRICS = Path("metrics/prepare.json")


class SidBuilderConfig(StageConfig):
    """Residual k-means semantic ids, used when `sid_file` is null or the data is raw."""

    dim: Count = 64
    # The built id is these levels plus a disambiguation code, and every later stage
    # reads ids of exactly len(SID_LEVELS) codes (gr2model.task.rerank_format).
    levels: Annotated[int, Field(ge=len(SID_LEVELS) - 1, le=len(SID_LEVELS) - 1)] = 3
    codebook_size: Annotated[int, Field(ge=2)] = 256  # one centroid cannot tell items apart
    seed: Seed = 0


class PrepareConfig(StageConfig):
    data_dir: str = "../shared/datasets/amazon-beauty"
    format: Literal["auto", "sequence", "raw"] = "auto"
    sequence_file: str = "Beauty.txt"
    attributes_file: str | None = "Beauty_item2attributes.json"
    sid_file: str | None = "Beauty_item2sid_rqvae.json"
    # The tokenizer and prompt format have one token level per code (SID_LEVELS).
    sid_length: Annotated[int, Field(ge=len(SID_LEVELS), le=len(SID_LEVELS))] = 4
    kcore: Count = 5
    # Leave-one-out needs a training part, a validation and a test item.
    min_seq_len: Annotated[int, Field(ge=3)] = 3
    max_users: Cap = 0
    sid_builder: SidBuilderConfig = SidBuilderConfig()


CONFIG = PrepareConfig


def load(cfg: PrepareConfig, root: Path, log: logging.Logger) -> tuple[Dataset, str]:
    """Load the configured source; returns the dataset and the format that was read."""
    data_dir = (root / cfg.data_dir).resolve()
    if not data_dir.is_dir():
        raise DataError(
            f"params.yaml: prepare.data_dir: folder {data_dir} does not exist; point it at the shared "
            "data set or run `gr2 data download` (see README, 'Getting the data')"
        )
    fmt = detect_format(data_dir, cfg.sequence_file) if cfg.format == "auto" else cfg.format
    max_users = cfg.max_users or None
    log.info("reading %s data from %s", fmt, data_dir)
    if fmt == "sequence":
        ds = load_sequence_dataset(
            data_dir,
            sequence_file=cfg.sequence_file,
            attributes_file=cfg.attributes_file,
            sid_file=cfg.sid_file,
            sid_length=cfg.sid_length,
            min_seq_len=cfg.min_seq_len,
            max_users=max_users,
        )
    else:
        reviews, meta = raw_reviews_files(data_dir)
        ds = load_raw_reviews(reviews, meta_path=meta, k=cfg.kcore, min_seq_len=cfg.min_seq_len, max_users=max_users)
    return ds, fmt


def add_semantic_ids(ds: Dataset, split: pl.DataFrame, cfg: SidBuilderConfig) -> tuple[Dataset, dict[str, float]]:
    """Build semantic ids from the training interactions only and put them on `ds.items`."""
    attrs = ds.attribute_map()
    item_ids = ds.items["item_id"].to_numpy()
    codes, stats = build_semantic_ids(
        split["train"].to_list(),
        attrs,
        item_ids,
        dim=cfg.dim,
        levels=cfg.levels,
        codebook_size=cfg.codebook_size,
        seed=cfg.seed,
    )
    items = ds.items.with_columns(pl.Series("sid", codes.tolist(), dtype=pl.List(pl.Int64)))
    return Dataset(ds.sequences, items, ds.user_keys, ds.item_keys), stats


def run(cfg: PrepareConfig, root: Path, log: logging.Logger, tracker: StageTracker) -> dict[str, Any]:
    """Load, split, build ids if needed, write `data/prepared/`; returns the stage metrics."""
    timings: dict[str, float] = {}
    start = time.perf_counter()
    with timed(log, "load", timings, "load_s"):
        ds, fmt = load(cfg, root, log)
    with timed(log, "leave-one-out split", timings, "split_s"):
        split = leave_one_out(ds.sequences)
    sid_stats: dict[str, float] = {}
    built = ds.items["sid"].null_count() > 0
    if built:
        with timed(log, "build semantic ids (residual k-means)", timings, "sid_build_s"):
            ds, sid_stats = add_semantic_ids(ds, split, cfg.sid_builder)
    codes = np.asarray(ds.items["sid"].to_list(), dtype=np.int64)
    with timed(log, f"write {OUT_DIR}", timings, "write_s"):
        save_prepared(ds, split, root / OUT_DIR)
    metrics: dict[str, Any] = {
        "format": fmt,
        "sid_source": "built" if built else str(cfg.sid_file),
        "users": ds.num_users,
        "items": int(ds.items.height),
        "interactions": ds.num_interactions,
        "avg_seq_len": round(ds.avg_seq_len, 2),
        "sid_unique_share": prefix_unique_share(codes, codes.shape[1]),
        "sid_prefix3_unique_share": prefix_unique_share(codes, min(3, codes.shape[1])),
        **{k: v for k, v in sid_stats.items() if k not in {"sid_unique_share", "sid_prefix_unique_share"}},
        **timings,
        "seconds": round(time.perf_counter() - start, 2),
    }
    log.info("prepared %d users, %d items, %d interactions", metrics["users"], metrics["items"], metrics["interactions"])
    tracker.set_tags({"format": fmt, "sid_source": metrics["sid_source"]})
    return metrics


def main() -> None:
    stage_main(STAGE, CONFIG, run, METRICS)


if __name__ == "__main__":
    main()
