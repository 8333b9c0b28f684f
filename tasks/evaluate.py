"""Stage `evaluate`: every re-ranker and baseline on the validation and test re-ranking examples.

Baselines: `prerank` (the incoming order), `teacher` (the expert teacher's own
ranking, without the target), `random` (a seeded shuffle). Models: every AR
checkpoint that exists among `MODELS`, decoded greedily with our KV-cache loop
and judged by the shared parser (an invalid answer falls back to the incoming
order and is counted). Writes `metrics/evaluate.json` as
`{model: {split: {metric: value}}}` and `reports/evaluate.md`.

    python -m tasks.evaluate
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch

from gr2model.checkpoint import load_hf_checkpoint
from gr2model.data import load_prepared
from gr2model.rerank_eval import fixed_rankings, lm_rerank, random_rankings, rerank_examples
from gr2model.rerank_format import RERANK_METRIC_NAMES, ItemText, rerank_metrics
from gr2model.teacher import ExpertTeacher
from tasks.traces import load_format
from tasks.common import StageConfig, stage_main, timed, write_text_atomic
from tasks.tracking import StageTracker

STAGE = "evaluate"
PREPARED = Path("data/prepared")
CANDIDATES = Path("data/candidates")
TRACES = Path("data/traces")
METRICS = Path("metrics/evaluate.json")
REPORT = Path("reports/evaluate.md")
# Model name in metrics/evaluate.json -> checkpoint folder (the contract in ARCHITECTURE.md).
MODELS: dict[str, Path] = {"gr2-sft": Path("checkpoints/gr2-sft"), "gr2": Path("checkpoints/gr2")}


class EvaluateConfig(StageConfig):
    splits: list[str] = ["valid", "test"]
    batch_size: int = 32
    max_new_tokens: int = 320
    max_examples: int = 0  # per split; 0 = every re-ranking example
    seed: int = 0


CONFIG = EvaluateConfig


def teacher_rankings(teacher: ExpertTeacher, lists: pl.DataFrame) -> list[list[int]]:
    """The teacher's ranking of each list from its scores alone (it does not see the target)."""
    out = []
    for hist, cands, scores in zip(lists["history"].to_list(), lists["candidates"].to_list(), lists["cand_scores"].to_list(), strict=True):
        order = np.argsort(-teacher.score(hist, cands, scores), kind="stable")
        out.append([cands[i] for i in order])
    return out


def markdown_table(results: dict[str, dict[str, dict[str, float]]], split: str) -> str:
    """One split of the results as a markdown table, models as rows."""
    cols = list(RERANK_METRIC_NAMES)
    lines = [f"| model | {' | '.join(cols)} |", f"|---|{'---|' * len(cols)}"]
    for model, by_split in results.items():
        if split in by_split:
            m = by_split[split]
            lines.append(f"| {model} | " + " | ".join(f"{m[c]:.4f}" if c != "n" else str(int(m[c])) for c in cols) + " |")
    return "\n".join(lines)


def run(cfg: EvaluateConfig, root: Path, log: logging.Logger, tracker: StageTracker) -> dict[str, Any]:
    """Evaluate every baseline and existing checkpoint; writes the report, returns `{model: {split: metrics}}`."""
    torch.manual_seed(cfg.seed)
    timings: dict[str, float] = {}
    ds, split = load_prepared(root / PREPARED)
    items = ItemText(ds.items)
    fmt = load_format(root)
    teacher_cfg = json.loads((root / TRACES / "teacher.json").read_text())
    teacher = ExpertTeacher(ds.items, split["train"].to_list(), ds.num_items)
    teacher.set_weights(teacher_cfg["weights"], teacher_cfg["evidence_weights"])

    lists = {}
    for name in cfg.splits:
        df = rerank_examples(pl.read_parquet(root / CANDIDATES / f"{name}.parquet"))
        lists[name] = df.head(cfg.max_examples) if cfg.max_examples else df
    results: dict[str, dict[str, dict[str, float]]] = {"prerank": {}, "teacher": {}, "random": {}}
    for name, df in lists.items():
        incoming = df["candidates"].to_list()
        targets = df["target"].to_list()
        results["prerank"][name] = rerank_metrics(fixed_rankings(incoming, incoming), targets)
        results["teacher"][name] = rerank_metrics(fixed_rankings(teacher_rankings(teacher, df), incoming), targets)
        results["random"][name] = rerank_metrics(fixed_rankings(random_rankings(incoming, cfg.seed), incoming), targets)

    for model_name, ckpt in MODELS.items():
        if not (root / ckpt).exists():
            log.info("%s: no checkpoint at %s; skipped", model_name, ckpt)
            continue
        model, tok = load_hf_checkpoint(root / ckpt)
        results[model_name] = {}
        for name, df in lists.items():
            with timed(log, f"{model_name} on {name} ({df.height} examples)", timings, f"{model_name}_{name}_s"):
                out = lm_rerank(model, tok, df, items, fmt, batch_size=cfg.batch_size, max_new_tokens=cfg.max_new_tokens, desc=f"{model_name} {name}")
            m = rerank_metrics(out.parsed, df["target"].to_list())
            m["tokens_per_s"] = out.generated_tokens / max(out.seconds, 1e-9)
            m["response_tokens"] = out.generated_tokens / max(len(out.parsed), 1)
            results[model_name][name] = m
            log.info("%s %s: %s", model_name, name, {k: round(v, 4) for k, v in m.items()})
        del model
    report = "\n\n".join(f"## {s}\n\n{markdown_table(results, s)}" for s in cfg.splits)
    write_text_atomic(f"# Re-ranking evaluation\n\n{report}\n", root / REPORT)
    tracker.log_artifact(root / REPORT)
    tracker.log_metrics(timings)
    return results


def main() -> None:
    stage_main(STAGE, CONFIG, run, METRICS)


if __name__ == "__main__":
    main()
