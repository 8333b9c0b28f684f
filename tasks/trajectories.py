"""Stage `trajectories`: GR2 decodes every training prompt; the full responses are the teacher trajectories.

Conversion fine-tuning of the diffusion model trains on these (prompt + GR2's
own response), so they are kept whole, with whether each is valid and correct.

    python -m tasks.trajectories
    accelerate launch --multi_gpu --num_processes N -m tasks.trajectories   # or GR2_LAUNCH=...

Under N processes each decodes its share of the batches (`lm_rerank(state=...)`);
the table is byte-identical to one process's.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import polars as pl

from gr2model.data.candidates import write_parquet_atomic
from gr2model.models.checkpoint import load_hf_checkpoint
from gr2model.data.dataset import load_prepared
from gr2model.eval.rerank_eval import lm_rerank
from gr2model.task.rerank_format import ItemText, rerank_metrics
from tasks.ar_rl import training_prompts
from tasks.traces import load_format
from tasks.common import Cap, Count, StageConfig, atomic_dir, process_state, stage_main, timed
from tasks.tracking import StageTracker

STAGE = "trajectories"
PREPARED = Path("data/prepared")
TRACES = Path("data/traces")
GR2 = Path("checkpoints/gr2")
OUT_DIR = Path("data/trajectories")
METRICS = Path("metrics/trajectories.json")


class TrajectoriesConfig(StageConfig):
    batch_size: Count = 32
    max_new_tokens: Count = 320
    max_examples: Cap = 0  # 0 = every training re-ranking example


CONFIG = TrajectoriesConfig


def run(cfg: TrajectoriesConfig, root: Path, log: logging.Logger, tracker: StageTracker) -> dict[str, Any]:
    timings: dict[str, float] = {}
    start = time.perf_counter()
    ds, _ = load_prepared(root / PREPARED)
    items = ItemText(ds.items)
    fmt = load_format(root)
    state = process_state()
    model, tok = load_hf_checkpoint(root / GR2)
    model.to(state.device)
    examples = training_prompts(root, fmt, items, cfg.max_examples)
    with timed(log, f"GR2 decodes {examples.height} training prompts on {state.num_processes} process(es)", timings, "decode_s"):
        out = lm_rerank(
            model, tok, examples, items, fmt, batch_size=cfg.batch_size, max_new_tokens=cfg.max_new_tokens,
            desc="trajectories", state=state,
        )  # fmt: skip
    table = examples.select("user_id", "position", "prompt", "candidates", "target").with_columns(
        pl.Series("response", out.texts),
        pl.Series("valid_format", [p.valid_format for p in out.parsed]),
        pl.Series("valid_permutation", [p.valid_permutation for p in out.parsed]),
        pl.Series("ranking", [p.ranking for p in out.parsed], dtype=pl.List(pl.Int64)),
        pl.Series("correct", [p.valid_permutation and p.ranking[0] == t for p, t in zip(out.parsed, examples["target"].to_list(), strict=True)]),
    )
    if state.is_main_process:  # every process holds the gathered table; one writes it
        with atomic_dir(root / OUT_DIR) as tmp:
            write_parquet_atomic(table, tmp / "train.parquet")
    return {
        "examples": table.height,
        **rerank_metrics(out.parsed, examples["target"].to_list()),
        "tokens_per_s": out.generated_tokens / max(out.seconds, 1e-9),
        "response_tokens": out.generated_tokens / max(table.height, 1),
        **timings,
        "seconds": round(time.perf_counter() - start, 2),
    }


def main() -> None:
    stage_main(STAGE, CONFIG, run, METRICS, distributed=True)


if __name__ == "__main__":
    main()
