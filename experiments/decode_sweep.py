"""Block-diffusion decoder settings on the first N test re-ranking examples, against our AR loop in the same run.

Each of `--runs` runs decodes the examples with our AR loop (GR2, greedy,
unconstrained: the benchmark's reference), then with the diffusion checkpoint
at every setting, under the answer grammar as `evaluate` decodes, at batch 1
unless --batch-size. One line per run and setting: the speed ratio to that
run's AR loop, AR's tokens/s, tokens per forward, and the share of answers
whose tokens (and rankings) equal the first setting's. A setting is
`TAU:S:ETAU:ES[:cache]`: the answer's threshold and sub-block size, the
explanation's threshold and sub-block size, and `cache` for the approximate
sub-block cache (`gr2model.decoding.diffusion_decode`).

    python experiments/decode_sweep.py --root WORKSPACE 0.9:8:0.9:32 0.9:8:0.9:8 0.9:8:0.9:8:cache

Set OMP_NUM_THREADS first (the pipeline runs with 2); only ratios measured in
one run mean anything on a shared CPU.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gr2model.decoding.ar_decode import ar_generate
from gr2model.models.checkpoint import load_hf_checkpoint
from gr2model.eval.rerank_eval import decoder_kwargs, lm_rerank
from tasks.evaluate import bench_inputs


def parse_setting(text: str) -> tuple[float, dict]:
    """`TAU:S:ETAU:ES[:cache]` -> (threshold, decoder_kwargs' other keyword arguments); ValueError naming the setting."""
    parts = text.split(":")
    if len(parts) not in (4, 5) or (len(parts) == 5 and parts[4] != "cache"):
        raise ValueError(f"setting {text!r}: expected TAU:S:ETAU:ES or TAU:S:ETAU:ES:cache")
    tau, sub, etau, esub = parts[:4]
    return float(tau), {
        "sub_block_size": int(sub), "explanation_threshold": float(etau), "explanation_sub_block_size": int(esub),
        "sub_block_cache": len(parts) == 5,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, required=True, help="a workspace with checkpoints/gr2 and the diffusion checkpoint")
    p.add_argument("settings", nargs="+", help="TAU:S:ETAU:ES[:cache]")
    p.add_argument("--checkpoint", default="checkpoints/dgr2")
    p.add_argument("--examples", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--runs", type=int, default=2)
    a = p.parse_args()
    settings = {s: parse_setting(s) for s in a.settings}
    fmt, items, lists = bench_inputs(a.root, a.examples)
    gr2, tok = load_hf_checkpoint(a.root / "checkpoints/gr2")
    model, _ = load_hf_checkpoint(a.root / a.checkpoint)
    common = dict(batch_size=a.batch_size, max_new_tokens=320)
    first = None  # the first setting's tokens and rankings: what the others are compared with
    for run in range(a.runs):
        ar = lm_rerank(gr2, tok, lists, items, fmt, decoder=ar_generate, desc="ar", **common)
        ar_rate = ar.generated_tokens / ar.seconds
        for name, (threshold, kw) in settings.items():
            args = decoder_kwargs(model, threshold, **kw)
            out = lm_rerank(model, tok, lists, items, fmt, desc=name, constrained=True, **args, **common)
            rankings = [r.ranking for r in out.parsed]
            first = first or (out.sequences, rankings)
            same = sum(x == y for x, y in zip(out.sequences, first[0])) / len(rankings)
            same_rank = sum(x == y for x, y in zip(rankings, first[1])) / len(rankings)
            forwards = sum(o.nfe * len(o.sequences) for o in out.outputs)
            print(
                f"run {run} {name:20s} {out.generated_tokens / out.seconds / ar_rate:.3f}x our AR loop (AR {ar_rate:.0f} tok/s), "
                f"{out.generated_tokens / max(forwards, 1):.2f} tokens per forward, same tokens {same:.2f}, same rankings {same_rank:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
