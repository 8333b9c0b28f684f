"""Stage `opd`: on-policy distillation of the CFT re-ranker from GR2 (closes the distributional gap).

CFT trained the diffusion model on GR2's fixed trajectories (off-policy). Here
the student decodes training prompts with its real decoder (block KV cache,
threshold rule, sampled), GR2 scores the same tokens in one causal forward, and
the student is trained toward GR2's per-token distributions on its own tokens
(forward KL by default), each token scored on the exact canvas it was committed
from (gr2model.training.opd, gr2model.training.diffusion_replay). The re-ranking reward of the
rollouts is logged, never trained on. With `train.cft_weight` > 0 every update
also keeps CFT's loss on GR2's trajectories (the ones CFT trained on, as the
student's recorded cft config selects them), so what the student learns from its
own rollouts does not cost it the structure CFT taught.

    python -m tasks.opd
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from gr2model.models.checkpoint import load_hf_checkpoint, read_stage_config
from gr2model.training.cft import CFTAnchor
from gr2model.training.opd import OPDConfig, train_opd
from gr2model.task.rewards import RewardConfig
from tasks.ar_rl import first_last_summary, rewarded_prompts
from tasks.cft import CftStageConfig, trajectory_pairs
from tasks.common import Cap, Seed, StageConfig, StageResume, save_stage_checkpoint, stage_main, timed
from tasks.tracking import StageTracker

STAGE = "opd"
STUDENT = Path("checkpoints/dgr2-cft")
TEACHER = Path("checkpoints/gr2")
CHECKPOINT = Path("checkpoints/dgr2-opd")
METRICS = Path("metrics/opd.json")


class OpdStageConfig(StageConfig):
    seed: Seed = 0
    max_prompts: Cap = 2000  # training re-ranking examples the prompts are drawn from (0 = all)
    # The library's config is the params schema (unknown keys and bad values name the field).
    train: OPDConfig = OPDConfig()


CONFIG = OpdStageConfig


def cft_anchor(root: Path, tok: Any, ocfg: OPDConfig, log: logging.Logger) -> CFTAnchor:
    """CFT's loss on the training trajectories the student was fine-tuned on (its checkpoint's recorded
    cft config: the same selection, noise rule and weights), for OPD to keep at `cft_weight`."""
    from accelerate import PartialState

    recorded = {k: v for k, v in read_stage_config(root / STUDENT).items() if k in CftStageConfig.model_fields}
    ccfg = CftStageConfig.model_validate(recorded)
    _, train, _ = trajectory_pairs(root, ccfg, log)
    state = PartialState()
    log.info("OPD keeps CFT's loss at weight %s on %d trajectories, %d per step", ocfg.cft_weight, len(train), ocfg.cft_batch_size)
    return CFTAnchor(tok, train, ccfg.train, batch_size=ocfg.cft_batch_size, seed=ocfg.seed, rank=state.process_index, world=state.num_processes)


def run(
    cfg: OpdStageConfig, root: Path, log: logging.Logger, tracker: StageTracker, resume: StageResume | None = None
) -> dict[str, Any]:
    """Distil GR2 into `checkpoints/dgr2-cft` on its own rollouts; save `checkpoints/dgr2-opd`."""
    timings: dict[str, float] = {}
    start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    student, tok = load_hf_checkpoint(root / STUDENT)
    teacher, _ = load_hf_checkpoint(root / TEACHER)
    prompts, reward_fn = rewarded_prompts(root, tok, cfg.max_prompts, RewardConfig())
    ocfg = cfg.train
    anchor = cft_anchor(root, tok, ocfg, log) if ocfg.cft_weight > 0 else None
    with timed(log, f"OPD: {ocfg.steps} steps x {ocfg.prompts_per_step} prompts x {ocfg.rollouts_per_prompt} rollouts ({ocfg.kind} KL)", timings, "train_s"):
        result = train_opd(
            student, teacher, tok, prompts, ocfg, reward_fn=reward_fn, on_step=tracker.log_step,
            checkpointer=resume.checkpointer() if resume else None, anchor=anchor,
        )
    save_stage_checkpoint(root / CHECKPOINT, result.model, tok, {"stage": STAGE, "from": str(STUDENT), "teacher": str(TEACHER), "cft": read_stage_config(root / STUDENT), STAGE: cfg.model_dump()})
    keys = sorted({k for h in result.history for k in h} & {"kl", "reward_mean", "format", "valid", "copy", "hit1", "tokens_per_forward", "cft_loss"})
    return {
        "steps": len(result.history),
        "prompts_available": len(prompts),
        # first and last fifth of training: KL to the teacher and the rollouts' own reward/validity
        **first_last_summary(result.history, keys),
        **timings,
        "seconds": round(time.perf_counter() - start, 2),
    }


def main() -> None:
    stage_main(STAGE, CONFIG, run, METRICS, resumable=True, distributed=True)


if __name__ == "__main__":
    main()
