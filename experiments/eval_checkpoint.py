"""Re-rank every validation and test re-ranking example with one AR checkpoint of a workspace.

The same call the `evaluate` stage makes for its AR rows (`lm_rerank`, greedy,
our KV-cache loop, the shared strict parser, invalid answers fall back to the
incoming order), with paired bootstrap 95% intervals of the difference to the
incoming order (2,000 resamples, seed 0). For a look at a checkpoint without
running the diffusion stages that `evaluate` waits for.

    python experiments/eval_checkpoint.py --root WORKSPACE checkpoints/gr2-sft checkpoints/gr2

Prints one JSON line per checkpoint and split.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from gr2model.checkpoint import load_hf_checkpoint
from gr2model.data import load_prepared
from gr2model.metrics import bootstrap_ci, per_example_gain
from gr2model.rerank_eval import lm_rerank, rerank_examples
from gr2model.rerank_format import ItemText, rerank_metrics, target_ranks
from tasks.traces import load_format, load_lists


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, required=True, help="a workspace that ran `traces` and trained the checkpoints")
    p.add_argument("checkpoints", nargs="+", help="checkpoint folders, relative to the workspace")
    p.add_argument("--splits", default="valid,test")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=320)
    a = p.parse_args()
    fmt = load_format(a.root)
    ds, _ = load_prepared(a.root / "data/prepared")
    items = ItemText(ds.items)
    for ckpt in a.checkpoints:
        model, tok = load_hf_checkpoint(a.root / ckpt)
        model.eval()
        for split in a.splits.split(","):
            lists = rerank_examples(load_lists(a.root, split))
            t0 = time.perf_counter()
            result = lm_rerank(model, tok, lists, items, fmt, batch_size=a.batch_size, max_new_tokens=a.max_new_tokens)
            targets = lists["target"].to_list()
            out: dict[str, object] = {"checkpoint": ckpt, "split": split, **rerank_metrics(result.parsed, targets)}
            ranks, incoming = target_ranks(result.parsed, targets), lists["target_rank"].to_numpy()
            for metric in ("recall@1", "ndcg@3"):
                mine, base = per_example_gain(ranks, metric), per_example_gain(incoming, metric)
                out[f"{metric}_vs_prerank"] = {"diff": float(mine.mean() - base.mean()), "ci95": bootstrap_ci(mine, baseline=base)}
            out["seconds"] = round(time.perf_counter() - t0, 1)
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
