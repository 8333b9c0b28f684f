"""Stage `sft`: train the AR re-ranker (a Qwen3-style causal LM) on the teacher's traces.

Starts from the mid-trained `checkpoints/gr2-base` (model and tokenizer, written
by the `midtrain` stage, which owns the model size and `pretrained_path`),
trains with a loss on the response only, reasoning and ranking tokens weighted
separately, and saves a `save_pretrained` checkpoint (model, tokenizer, stage
config, marker last).

    python -m tasks.sft
    accelerate launch --num_processes N -m tasks.sft   # or GR2_LAUNCH="accelerate launch ..." python -m tasks.sft

`sft.train.batch_size` is the global batch: N processes take the same steps as one.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import polars as pl
import torch

from gr2model.models.ar_model import count_parameters
from gr2model.models.checkpoint import load_hf_checkpoint, read_stage_config
from gr2model.training.sft import SFTConfig, train_sft
from tasks.common import Cap, Fraction, ParamsError, Seed, StageConfig, StageResume, save_stage_checkpoint, stage_main, timed
from tasks.tracking import StageTracker

STAGE = "sft"
BASE = Path("checkpoints/gr2-base")  # the mid-trained model (stage `midtrain`)
TRACES = Path("data/traces")
CHECKPOINT = Path("checkpoints/gr2-sft")
METRICS = Path("metrics/sft.json")


class SftStageConfig(StageConfig):
    seed: Seed = 0  # model initialisation and the train/valid split
    # The library's configs are the params schema (unknown keys and bad values name the field).
    # The model (size, pretrained_path) comes from checkpoints/gr2-base: see `midtrain.model`.
    train: SFTConfig = SFTConfig(epochs=2, lr=2e-3)
    valid_fraction: Fraction = 0.05  # traces held out for a validation loss (0: none)
    max_examples: Cap = 0  # 0 = every kept trace


CONFIG = SftStageConfig


def run(
    cfg: SftStageConfig, root: Path, log: logging.Logger, tracker: StageTracker, resume: StageResume | None = None
) -> dict[str, Any]:
    """Train on the kept traces and save `checkpoints/gr2-sft`; returns the stage metrics."""
    timings: dict[str, float] = {}
    start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    path = root / TRACES / "train.parquet"
    traces = pl.read_parquet(path).filter(pl.col("kept"))
    columns: list[list[Any]] = [traces["prompt"].to_list(), traces["response"].to_list()]
    if cfg.train.decision_weight > 0:
        if "teacher_scores" not in traces.columns:
            raise ParamsError(f"sft.train.decision_weight: {path} has no teacher_scores column (traces written before it existed): rerun `traces`")
        columns.append(traces["teacher_scores"].to_list())
    pairs = list(zip(*columns, strict=True))
    if cfg.max_examples:
        pairs = pairs[: cfg.max_examples]
    if not pairs:
        raise RuntimeError(f"{path}: no kept traces to train on")
    rng = random.Random(cfg.seed)
    rng.shuffle(pairs)
    n_valid = max(1, int(len(pairs) * cfg.valid_fraction)) if cfg.valid_fraction > 0 else 0
    valid, train = pairs[:n_valid], pairs[n_valid:]

    model, tok = load_hf_checkpoint(root / BASE)
    n_params = count_parameters(model)
    log.info("model from %s: %d parameters, vocabulary %d; %d training / %d validation traces", BASE, n_params, len(tok), len(train), len(valid))

    scfg = cfg.train
    with timed(log, f"SFT for {scfg.epochs} epochs", timings, "train_s"):
        result = train_sft(
            model, tok, train, scfg, valid=valid or None, on_step=tracker.log_step,
            checkpointer=resume.checkpointer() if resume else None,
        )
    save_stage_checkpoint(root / CHECKPOINT, result.model, tok, {"stage": STAGE, **cfg.model_dump(), "from": str(BASE), "midtrain": read_stage_config(root / BASE)})
    last = next((h for h in reversed(result.history) if "loss" in h), {})
    valid_losses = [h for h in result.history if any(k.startswith("valid") for k in h)]
    return {
        "parameters": n_params,
        "vocab_size": len(tok),
        "train_traces": len(train),
        "valid_traces": len(valid),
        "steps": result.steps,
        "final_train_loss": last.get("loss"),
        "valid": {k: v for k, v in (valid_losses[-1] if valid_losses else {}).items() if k.startswith("valid")},
        **timings,
        "seconds": round(time.perf_counter() - start, 2),
    }


def main() -> None:
    stage_main(STAGE, CONFIG, run, METRICS, resumable=True, distributed=True)


if __name__ == "__main__":
    main()
