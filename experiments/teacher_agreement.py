"""How far a teacher that reads only the prompt is from the workspace's teacher.

The student sees its prompt: positions, semantic ids, attributes and the evidence
levels (`traces.evidence`). The default teacher ranks with features the prompt does
not show, so some of its picks are not a function of what the student reads. This
fits the LTR teacher on what the prompt shows (`traces.ltr.features: prompt`, fitted
as `traces` fits it) and compares, on every validation and test re-ranking list, its
first pick with the workspace teacher's and with the incoming first item, beside both
teachers' R@1 and NDCG@3 (paired bootstrap intervals of prompt minus workspace teacher).

    python experiments/teacher_agreement.py --root WORKSPACE

Prints one JSON line per split.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import polars as pl
import yaml

from gr2model.data.dataset import load_prepared
from gr2model.eval.rerank_eval import fixed_rankings, rerank_examples
from tasks.evaluate import CI_METRICS, load_teacher, paired_difference, scored, teacher_rankings
from tasks.traces import TracesConfig, fit_teacher, load_lists


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, required=True, help="a workspace that ran `traces` with the LTR teacher")
    p.add_argument("--splits", default="valid,test")
    a = p.parse_args()
    t0 = time.perf_counter()
    cfg = TracesConfig(**yaml.safe_load((a.root / "params.yaml").read_text())["traces"])
    if cfg.teacher != "ltr" or cfg.ltr.features == "prompt":
        raise SystemExit(f"{a.root / 'params.yaml'}: traces.teacher must be ltr with features other than prompt (got {cfg.teacher}, {cfg.ltr.features})")
    ds, split = load_prepared(a.root / "data/prepared")
    train = pl.read_parquet(a.root / "data/candidates/train.parquet")
    valid = pl.read_parquet(a.root / "data/candidates/valid.parquet")
    prompt_cfg = cfg.model_copy(update={"ltr": replace(cfg.ltr, features="prompt")})
    prompt_teacher, _, info = fit_teacher(prompt_cfg, ds, split, train, valid)
    teacher = load_teacher(a.root, ds.items, split["train"].to_list(), ds.num_items)
    print(json.dumps({"prompt_teacher_features": list(prompt_teacher.feature_names), "best_iteration": (info or {}).get("best_iteration")}), flush=True)
    for name in a.splits.split(","):
        lists = rerank_examples(load_lists(a.root, name))
        targets = lists["target"].to_list()
        incoming = lists["candidates"].to_list()
        ours, theirs = teacher_rankings(teacher, lists), teacher_rankings(prompt_teacher, lists)
        m_ours, r_ours = scored(fixed_rankings(ours, incoming), targets)
        m_theirs, r_theirs = scored(fixed_rankings(theirs, incoming), targets)
        n = len(incoming)
        print(json.dumps({
            "split": name,
            "n": n,
            "teacher": {m: m_ours[m] for m in CI_METRICS},
            "prompt_teacher": {m: m_theirs[m] for m in CI_METRICS},
            "prompt_minus_teacher": {m: paired_difference(r_theirs, r_ours, m, n_boot=2000, seed=0) for m in CI_METRICS},
            "first_pick_agreement": sum(x[0] == y[0] for x, y in zip(ours, theirs, strict=True)) / n,
            "teacher_moves_first": sum(x[0] != c[0] for x, c in zip(ours, incoming, strict=True)) / n,
            "prompt_teacher_moves_first": sum(y[0] != c[0] for y, c in zip(theirs, incoming, strict=True)) / n,
            "seconds": round(time.perf_counter() - t0, 1),
        }), flush=True)


if __name__ == "__main__":
    main()
