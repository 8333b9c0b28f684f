"""Stage `rl`: RL of the diffusion re-ranker (trajectory-level DAPO with step replay) -> Diffusion-GR2.

Starts from the OPD checkpoint. Rollouts come from the real decoder and record
the step at which each token was committed; the update replays each step's
masked canvas to score those tokens under the current policy and clips the
per-token importance ratio (gr2model.training.diffusion_rl). The reward is ar_rl's
conditional verifiable reward: rank promotion of the target, a format bonus
only when the target moved up (or stayed first), -1 for an invalid answer.

    python -m tasks.rl
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from gr2model.models.checkpoint import load_hf_checkpoint, read_stage_config
from gr2model.training.diffusion_rl import DiffusionRLConfig, train_diffusion_rl
from gr2model.task.rewards import RewardConfig
from tasks.ar_rl import first_last_summary, rewarded_prompts
from tasks.common import Cap, NonNegative, Penalty, Seed, StageConfig, StageResume, save_stage_checkpoint, stage_main, timed
from tasks.tracking import StageTracker

STAGE = "rl"
START = Path("checkpoints/dgr2-opd")
CHECKPOINT = Path("checkpoints/dgr2")
METRICS = Path("metrics/rl.json")


class RlStageConfig(StageConfig):
    seed: Seed = 0
    max_prompts: Cap = 2000  # training re-ranking examples the prompts are drawn from (0 = all)
    format_bonus: NonNegative = 0.2
    invalid_penalty: Penalty = -1.0
    # The library's config is the params schema (unknown keys and bad values name the field).
    train: DiffusionRLConfig = DiffusionRLConfig()


CONFIG = RlStageConfig


def run(
    cfg: RlStageConfig, root: Path, log: logging.Logger, tracker: StageTracker, resume: StageResume | None = None
) -> dict[str, Any]:
    """RL of `checkpoints/dgr2-opd` against the re-ranking reward; save `checkpoints/dgr2`."""
    timings: dict[str, float] = {}
    start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    model, tok = load_hf_checkpoint(root / START)
    reward = RewardConfig(format_bonus=cfg.format_bonus, invalid_penalty=cfg.invalid_penalty)
    prompts, reward_fn = rewarded_prompts(root, tok, cfg.max_prompts, reward)
    rcfg = cfg.train
    with timed(log, f"diffusion RL: {rcfg.steps} steps x {rcfg.prompts_per_step} prompts x {rcfg.group_size} rollouts", timings, "train_s"):
        result = train_diffusion_rl(
            model, tok, prompts, reward_fn, rcfg, on_step=tracker.log_step,
            checkpointer=resume.checkpointer() if resume else None,
        )
    save_stage_checkpoint(root / CHECKPOINT, result.model, tok, {"stage": STAGE, "from": str(START), "opd": read_stage_config(root / START), STAGE: cfg.model_dump()})
    return {
        "steps": len(result.history),
        "prompts_available": len(prompts),
        **first_last_summary(result.history, ("reward_mean", "format", "valid", "copy", "hit1", "tokens_per_forward")),
        **timings,
        "seconds": round(time.perf_counter() - start, 2),
    }


def main() -> None:
    stage_main(STAGE, CONFIG, run, METRICS, resumable=True, distributed=True)


if __name__ == "__main__":
    main()
