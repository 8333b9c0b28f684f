"""Stage `ar_rl`: DAPO of the SFT re-ranker with the conditional verifiable reward -> GR2, the AR teacher.

Rollouts are the model's own sampled answers to training prompts; the reward
(gr2model.task.rewards.rerank_reward) pays for moving the target up and pays the
format bonus only when it did, so copying the incoming order earns nothing, and
an invalid answer scores -1. No KL penalty (DAPO).

    python -m tasks.ar_rl
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import polars as pl
import torch

from gr2model.models.checkpoint import load_hf_checkpoint, read_stage_config
from gr2model.training.dapo import DAPOConfig, RewardFn, train_dapo
from gr2model.data.dataset import load_prepared
from gr2model.eval.rerank_eval import prompts_of, rerank_examples
from gr2model.task.rerank_format import FormatConfig, ItemText, parse_response
from gr2model.task.rewards import RewardConfig, rerank_reward
from tasks.traces import load_format, load_lists
from tasks.common import Cap, NonNegative, Penalty, Seed, StageConfig, StageResume, save_stage_checkpoint, stage_main, timed
from tasks.tracking import StageTracker

STAGE = "ar_rl"
PREPARED = Path("data/prepared")
TRACES = Path("data/traces")
SFT_CHECKPOINT = Path("checkpoints/gr2-sft")
CHECKPOINT = Path("checkpoints/gr2")
METRICS = Path("metrics/ar_rl.json")


class ArRlConfig(StageConfig):
    seed: Seed = 0
    format_bonus: NonNegative = 0.2
    invalid_penalty: Penalty = -1.0
    max_prompts: Cap = 2000  # training re-ranking examples the prompts are drawn from (0 = all)
    # The library's config is the params schema (unknown keys and bad values name the field).
    train: DAPOConfig = DAPOConfig(max_new_tokens=320)


CONFIG = ArRlConfig


def training_prompts(root: Path, fmt: FormatConfig, items: ItemText, max_prompts: int) -> pl.DataFrame:
    """Training re-ranking examples with their prompt text (the prompts RL and trajectories decode)."""
    lists = rerank_examples(load_lists(root, "train"))
    if max_prompts:
        lists = lists.head(max_prompts)
    return lists.with_columns(pl.Series("prompt", prompts_of(lists, items, fmt)))


def make_reward_fn(
    tok: Any, examples: pl.DataFrame, items: ItemText, rcfg: RewardConfig, fmt: FormatConfig | None = None
) -> RewardFn:
    """The conditional verifiable reward of a completion of training prompt i (ar_rl, opd monitoring, rl).

    Info logged per step: format (valid JSON in the answer format), valid (a valid
    permutation), copy (the incoming order copied), hit1 (the target ranked first).
    """
    candidates = examples["candidates"].to_list()
    targets = examples["target"].to_list()

    def reward_fn(i: int, completion: list[int]) -> tuple[float, dict[str, float]]:
        parsed = parse_response(tok.decode(completion, skip_special_tokens=False), candidates[i], items, fmt=fmt)
        info = {
            "format": float(parsed.valid_format),
            "valid": float(parsed.valid_permutation),
            "copy": float(parsed.copies_incoming),
            "hit1": float(parsed.ranking[0] == targets[i]),
        }
        return rerank_reward(parsed, candidates[i], targets[i], rcfg), info

    return reward_fn


def first_last_summary(history: list[dict[str, float]], keys: Sequence[str]) -> dict[str, float | None]:
    """Mean of each key over the first and the last fifth of the steps: `{key}_first`, `{key}_last`."""
    head, tail = history[: max(1, len(history) // 5)], history[-max(1, len(history) // 5) :]

    def avg(rows: list[dict[str, float]], key: str) -> float | None:
        vals = [r[key] for r in rows if key in r]
        return sum(vals) / len(vals) if vals else None

    return {f"{k}_{when}": avg(rows, k) for k in keys for when, rows in (("first", head), ("last", tail))}


def rewarded_prompts(root: Path, tok: Any, max_prompts: int, rcfg: RewardConfig) -> tuple[list[list[int]], RewardFn]:
    """The training prompts an RL-style stage draws from (token ids), and the reward of a completion of prompt i."""
    ds, _ = load_prepared(root / PREPARED)
    items = ItemText(ds.items)
    fmt = load_format(root)
    examples = training_prompts(root, fmt, items, max_prompts)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in examples["prompt"].to_list()]
    return prompts, make_reward_fn(tok, examples, items, rcfg, fmt)


def run(
    cfg: ArRlConfig, root: Path, log: logging.Logger, tracker: StageTracker, resume: StageResume | None = None
) -> dict[str, Any]:
    timings: dict[str, float] = {}
    start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    model, tok = load_hf_checkpoint(root / SFT_CHECKPOINT)
    rcfg = RewardConfig(format_bonus=cfg.format_bonus, invalid_penalty=cfg.invalid_penalty)
    prompts, reward_fn = rewarded_prompts(root, tok, cfg.max_prompts, rcfg)

    dcfg = cfg.train
    with timed(log, f"DAPO: {dcfg.steps} steps x {dcfg.prompts_per_step} prompts x {dcfg.group_size} samples", timings, "train_s"):
        result = train_dapo(
            model, tok, prompts, reward_fn, dcfg,
            on_step=tracker.log_step, checkpointer=resume.checkpointer() if resume else None,
        )
    save_stage_checkpoint(root / CHECKPOINT, result.model, tok, {"stage": STAGE, "from": str(SFT_CHECKPOINT), "sft": read_stage_config(root / SFT_CHECKPOINT), STAGE: cfg.model_dump()})
    return {
        "steps": len(result.history),
        "prompts_available": len(prompts),
        # first and last fifth of training: the rollouts' own reward, validity and copy rate
        **first_last_summary(result.history, ("reward_mean", "format", "valid", "copy", "hit1")),
        **timings,
        "seconds": round(time.perf_counter() - start, 2),
    }


def main() -> None:
    stage_main(STAGE, CONFIG, run, METRICS, resumable=True, distributed=True)


if __name__ == "__main__":
    main()
