"""Re-rank every validation and test re-ranking example with checkpoints of a workspace.

The same call the `evaluate` stage makes (`lm_rerank`, greedy, the shared
strict parser, invalid answers fall back to the incoming order): our KV-cache
loop for an AR checkpoint, the threshold decoder (`--tau`, `--sub-block-size`)
for a block-diffusion one, with paired bootstrap 95% intervals of the
difference to the incoming order (2,000 resamples, seed 0). For a look at a
checkpoint without running the stages that `evaluate` waits for.

    python experiments/eval_checkpoint.py --root WORKSPACE checkpoints/gr2-sft checkpoints/gr2
    python experiments/eval_checkpoint.py --root WORKSPACE --splits test --max-examples 300 --sub-block-size 8 checkpoints/dgr2-cft
    python experiments/eval_checkpoint.py --root WORKSPACE --constrained --explanation-tau 0.5 checkpoints/gr2 checkpoints/dgr2
    python experiments/eval_checkpoint.py --root WORKSPACE --no-reasoning checkpoints/gr2

`--no-reasoning` decodes each checkpoint a second time with its explanation forced
empty (`rerank_format.no_reasoning_prefix`, evaluate's `gr2-no-reasoning` row), as
the checkpoint `<ckpt>:no-reasoning`, with its paired differences to the first.

`--invalid-out DIR` keeps every invalid response with the check it failed; each line also
counts them by check (`errors`).

`--max-examples N` scores the first N examples of each split only: a quick
look while tuning, not a result (evaluate scores every example).

Prints one JSON line per checkpoint and split, then, when several checkpoints
are given, one line per later checkpoint and split with its paired differences
to the first (`<metric>_vs_first`: R@1 and NDCG@3, same resamples) and
`top1_agreement_vs_first`, the share of examples whose first item (as parsed) is
the first checkpoint's (`checkpoints/gr2` first: evaluate's `top1_agreement_vs_gr2`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gr2model.eval.bench import row_forwards
from gr2model.models.checkpoint import load_hf_checkpoint
from gr2model.data.dataset import load_prepared
from gr2model.eval.rerank_eval import decoder_kwargs, fixed_rankings, lm_rerank, rerank_examples
from gr2model.task.rerank_format import ItemText, ParsedResponse, no_reasoning_prefix
from tasks.common import write_text_atomic
from tasks.evaluate import CI_METRICS, add_intervals, paired_difference, scored, top1_agreement
from tasks.traces import load_format, load_lists


def write_invalid(path: Path, parsed: Sequence[ParsedResponse], texts: Sequence[str], user_ids: Sequence[int]) -> None:
    """One JSON line per invalid response: its example index, user, the parser's error and the decoded text."""
    lines = [
        json.dumps({"example": i, "user_id": int(u), "error": p.error, "text": t})
        for i, (p, t, u) in enumerate(zip(parsed, texts, user_ids, strict=True))
        if p.error
    ]
    write_text_atomic("".join(line + "\n" for line in lines), path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, required=True, help="a workspace that ran `traces` and trained the checkpoints")
    p.add_argument("checkpoints", nargs="+", help="checkpoint folders, relative to the workspace")
    p.add_argument("--splits", default="valid,test")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=320)
    p.add_argument("--tau", type=float, default=0.9, help="commit threshold of a block-diffusion checkpoint")
    p.add_argument("--sub-block-size", type=int, default=None, help="its sub-block size (default: the whole block)")
    p.add_argument("--max-examples", type=int, default=0, help="first N examples per split (0: all)")
    p.add_argument("--constrained", action="store_true", help="decode under the answer grammar (gr2model.decoding.constrained)")
    p.add_argument("--explanation-tau", type=float, default=None, help="a diffusion checkpoint's threshold after the answer (needs --constrained)")
    p.add_argument("--explanation-sub-block-size", type=int, default=None, help="its sub-block size past the answer (needs --constrained)")
    p.add_argument("--sub-block-cache", action="store_true", help="decode a diffusion checkpoint with the approximate sub-block cache")
    p.add_argument("--no-reasoning", action="store_true", help="also decode each checkpoint with its explanation forced empty")
    p.add_argument("--invalid-out", type=Path, default=None, help="write every invalid response (the parser's error and the text) to DIR/<checkpoint>.<split>.jsonl")
    a = p.parse_args()
    fmt = load_format(a.root)
    ds, _ = load_prepared(a.root / "data/prepared")
    items = ItemText(ds.items)
    lists = {split: rerank_examples(load_lists(a.root, split)) for split in a.splits.split(",")}
    if a.max_examples:
        lists = {split: df.head(a.max_examples) for split, df in lists.items()}
    # The incoming order, scored as evaluate scores its prerank row: the reference of the paired differences.
    prerank = {s: scored(fixed_rankings(df["candidates"].to_list(), df["candidates"].to_list()), df["target"].to_list()) for s, df in lists.items()}
    first: dict[str, np.ndarray] = {}  # the first checkpoint's per-example target ranks, per split
    first_items: dict[str, list[int]] = {}  # ... and each example's first item, as parsed
    runs = [(c, "") for c in a.checkpoints]
    if a.no_reasoning:
        runs += [(f"{c}:no-reasoning", no_reasoning_prefix(fmt)) for c in a.checkpoints]
    for ckpt, prefix in runs:
        model, tok = load_hf_checkpoint(a.root / ckpt.removesuffix(":no-reasoning"))
        model.eval()
        results: dict[str, dict[str, dict]] = {"prerank": {s: m for s, (m, _) in prerank.items()}, ckpt: {}}
        ranks: dict[str, dict[str, np.ndarray]] = {"prerank": {s: r for s, (_, r) in prerank.items()}, ckpt: {}}
        firsts: dict[str, list[int]] = {}
        seconds = {}
        for split, df in lists.items():
            t0 = time.perf_counter()
            result = lm_rerank(
                model, tok, df, items, fmt, batch_size=a.batch_size, max_new_tokens=a.max_new_tokens,
                constrained=a.constrained, response_prefix=prefix,
                **decoder_kwargs(model, a.tau, sub_block_size=a.sub_block_size, explanation_threshold=a.explanation_tau, explanation_sub_block_size=a.explanation_sub_block_size, sub_block_cache=a.sub_block_cache),
            )
            results[ckpt][split], ranks[ckpt][split] = scored(result.parsed, df["target"].to_list())
            # Which check the invalid answers fail: duplicates and broken JSON call for different fixes.
            results[ckpt][split]["errors"] = dict(Counter(p.error for p in result.parsed if p.error).most_common())
            if a.invalid_out is not None:
                write_invalid(a.invalid_out / f"{ckpt.replace('/', '_')}.{split}.jsonl", result.parsed, result.texts, df["user_id"].to_list())
            firsts[split] = [p.ranking[0] for p in result.parsed]
            seconds[split] = round(time.perf_counter() - t0, 1)
            # Per row, as the benchmark's: a batch forward serves each of its rows.
            results[ckpt][split]["tokens_per_forward"] = result.generated_tokens / max(row_forwards(result), 1)
            if a.constrained:
                results[ckpt][split]["grammar_changed_rate"] = result.grammar_changed_rate
        add_intervals(results, ranks, n_boot=2000, seed=0)  # evaluate's intervals: paired differences to prerank
        for split in lists:
            print(json.dumps({"checkpoint": ckpt, "split": split, **results[ckpt][split], "seconds": seconds[split]}), flush=True)
        if not first:
            first, first_items = ranks[ckpt], firsts
            continue
        for split in lists:  # paired on the same examples in the same order, as evaluate's `_vs_` intervals
            vs = {
                f"{metric}_vs_first": paired_difference(ranks[ckpt][split], first[split], metric, n_boot=2000, seed=0)
                for metric in CI_METRICS
            }
            vs["top1_agreement_vs_first"] = top1_agreement(firsts[split], first_items[split])
            print(json.dumps({"checkpoint": ckpt, "first": a.checkpoints[0], "split": split, **vs}), flush=True)


if __name__ == "__main__":
    main()
