"""Stage `cft`: convert GR2 into a block-diffusion re-ranker and fine-tune it on GR2's trajectories.

Conversion (gr2model.models.block_diffusion.convert_to_block_diffusion) copies GR2's
weights one to one into the same architecture; only the config changes (block
size, mask token). The naive conversion cannot write a valid ranking on its own
(parallel positions are scored independently), so conversion fine-tuning
(gr2model.training.cft.train_cft) trains it with the block-diffusion objective on the
teacher trajectories: GR2's own responses to the training prompts.

Which trajectories: by default only those whose answer is a valid permutation
(`only_valid`): CFT is there to teach the structure, so an invalid answer would
teach the wrong one. Correctness is not required: the student should imitate
GR2's distribution, not a filtered better one (that is the job of `rl`).

    python -m tasks.cft
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import polars as pl
import torch

from gr2model.models.block_diffusion import convert_to_block_diffusion
from gr2model.training.cft import CFTConfig, train_cft
from gr2model.models.checkpoint import load_hf_checkpoint, read_stage_config
from tasks.common import Cap, Fraction, Seed, StageConfig, StageResume, save_stage_checkpoint, stage_main, timed
from tasks.tracking import StageTracker

STAGE = "cft"
GR2 = Path("checkpoints/gr2")
TRAJECTORIES = Path("data/trajectories")
CHECKPOINT = Path("checkpoints/dgr2-cft")
METRICS = Path("metrics/cft.json")


class CftStageConfig(StageConfig):
    seed: Seed = 0  # the train/valid split
    only_valid: bool = True  # train only on trajectories whose answer is a valid permutation
    valid_fraction: Fraction = 0.05  # trajectories held out for a validation loss (0: none)
    max_examples: Cap = 0  # 0 = every (kept) trajectory
    # The library's config is the params schema (unknown keys and bad values name the field).
    train: CFTConfig = CFTConfig(block_size=32)


CONFIG = CftStageConfig


def trajectory_pairs(root: Path, cfg: CftStageConfig, log: logging.Logger) -> tuple[int, list[tuple[str, str]], list[tuple[str, str]]]:
    """(trajectories in the file, train pairs, validation pairs): the (prompt, response) pairs CFT trains
    and validates on, as `cfg` selects them (only_valid, max_examples, the seeded split)."""
    table = pl.read_parquet(root / TRAJECTORIES / "train.parquet")
    kept = table.filter(pl.col("valid_permutation")) if cfg.only_valid else table
    pairs = list(zip(kept["prompt"].to_list(), kept["response"].to_list(), strict=True))
    if cfg.max_examples:
        pairs = pairs[: cfg.max_examples]
    if not pairs:
        raise RuntimeError(f"{root / TRAJECTORIES / 'train.parquet'}: no trajectories to train on (only_valid={cfg.only_valid})")
    rng = random.Random(cfg.seed)
    rng.shuffle(pairs)
    n_valid = max(1, int(len(pairs) * cfg.valid_fraction)) if cfg.valid_fraction > 0 and len(pairs) > 1 else 0
    valid, train = pairs[:n_valid], pairs[n_valid:]
    log.info(
        "%d trajectories, %d kept (only_valid=%s), %d used (max_examples=%d): %d train / %d validation",
        table.height, kept.height, cfg.only_valid, len(pairs), cfg.max_examples, len(train), len(valid),
    )  # fmt: skip
    return table.height, train, valid


def run(
    cfg: CftStageConfig, root: Path, log: logging.Logger, tracker: StageTracker, resume: StageResume | None = None
) -> dict[str, Any]:
    """Convert `checkpoints/gr2`, fine-tune on the trajectories, save `checkpoints/dgr2-cft`."""
    timings: dict[str, float] = {}
    start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    n_trajectories, train, valid = trajectory_pairs(root, cfg, log)

    ar_model, tok = load_hf_checkpoint(root / GR2)
    ccfg = cfg.train
    model = convert_to_block_diffusion(ar_model, tok, ccfg.block_size)
    # With kd_weight > 0 GR2 stays loaded as the frozen teacher of the distillation term.
    teacher = ar_model if ccfg.kd_weight > 0 else None
    del ar_model
    with timed(log, f"CFT for {ccfg.epochs} epochs (block size {ccfg.block_size}, kd_weight {ccfg.kd_weight})", timings, "train_s"):
        result = train_cft(
            model, tok, train, ccfg, valid=valid or None, on_step=tracker.log_step, teacher=teacher,
            checkpointer=resume.checkpointer() if resume else None,
        )
    lineage = read_stage_config(root / GR2)
    save_stage_checkpoint(root / CHECKPOINT, result.model, tok, {"stage": STAGE, **cfg.model_dump(), "converted_from": lineage})
    last = next((h for h in reversed(result.history) if "loss" in h), {})
    valid_losses = [h for h in result.history if any(k.startswith("valid") for k in h)]
    return {
        "trajectories": n_trajectories,
        "kept": len(train) + len(valid),
        "train_examples": len(train),
        "valid_examples": len(valid),
        "block_size": ccfg.block_size,
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
