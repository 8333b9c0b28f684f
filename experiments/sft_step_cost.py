"""Time one SFT optimizer step on a workspace's own traces: the logits at the predicted positions only
(`sft_loss_sums`, what `sft` and `midtrain` train with) against the full (B, T, V) logits of every
position (`weighted_lm_loss` on the whole output), in the same run.

Usage (from the project root):
    OMP_NUM_THREADS=2 .venv/bin/python experiments/sft_step_cost.py --root WS [--batches 6] [--repeats 3]

Needs `WS/data/traces/train.parquet` (stage `traces`) and `WS/checkpoints/gr2-base` (stage
`midtrain`). Takes the first `--batches` length-grouped batches of `sft.train.batch_size` kept
traces (seeded as `sft` draws them), warms up once on each, then times forward, backward and an
AdamW step of each batch `--repeats` times per loss, the two losses alternating batch by batch so
that machine drift hits both alike. Prints the median seconds per step of each, their ratio, the
share of positions that predict a token, and the largest difference of the two losses (they must
agree: the kept logits are the same numbers).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import polars as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gr2model.models.checkpoint import load_hf_checkpoint  # noqa: E402
from gr2model.training.sft import (  # noqa: E402
    IGNORE_INDEX,
    LengthGroupedBatches,
    SFTConfig,
    collate_right_padded,
    encode_example,
    sft_loss_sums,
    weighted_lm_loss,
)
from tasks.common import read_params  # noqa: E402


def full_logits_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """sum(w * nll) from the (B, T, V) logits of every position: the reference."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    w = (batch["weights"][:, 1:].float() * (batch["labels"][:, 1:] != IGNORE_INDEX)).sum()
    return weighted_lm_loss(logits, batch["labels"], batch["weights"]) * w


def kept_logits_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return sft_loss_sums(model, batch)[0]


LossFn = Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor]


def step_seconds(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor], loss_fn: LossFn) -> tuple[float, float]:
    """(seconds, loss) of forward + backward + optimizer step on one batch."""
    start = time.perf_counter()
    loss = loss_fn(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start, float(loss.detach())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path("."))
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    params = read_params(args.root / "params.yaml")["sft"]["train"]
    cfg = SFTConfig(**params)
    traces_path = args.root / "data" / "traces" / "train.parquet"
    traces = pl.read_parquet(traces_path).filter(pl.col("kept"))
    model, tok = load_hf_checkpoint(args.root / "checkpoints" / "gr2-base")
    n_needed = cfg.batch_size * args.batches * 4
    enc = [encode_example(tok, p, r, cfg) for p, r in zip(traces["prompt"][:n_needed], traces["response"][:n_needed])]
    sampler = LengthGroupedBatches([len(e["input_ids"]) for e in enc], cfg.batch_size, cfg.seed)
    batches = [collate_right_padded([enc[i] for i in idx], tok.pad_token_id) for idx in list(sampler)[: args.batches]]
    positions = sum(int(b["attention_mask"].sum()) for b in batches)
    predicted = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in batches)
    print(f"{len(batches)} batches of {cfg.batch_size}, {positions} positions, {predicted / positions:.3f} of them predict a token, vocabulary {len(tok)}", flush=True)

    runs: dict[str, LossFn] = {"full logits": full_logits_loss, "kept logits": kept_logits_loss}
    models = {name: copy.deepcopy(model).train() for name in runs}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=0.0) for name, m in models.items()}  # lr 0: every repeat sees the same weights
    times: dict[str, list[float]] = {name: [] for name in runs}
    gap = 0.0
    for i, batch in enumerate(batches):
        losses = {}
        for name, fn in runs.items():
            step_seconds(models[name], opts[name], batch, fn)  # warm-up
        for _ in range(args.repeats):
            for name, fn in runs.items():
                seconds, losses[name] = step_seconds(models[name], opts[name], batch, fn)
                times[name].append(seconds)
        gap = max(gap, abs(losses["full logits"] - losses["kept logits"]) / max(abs(losses["full logits"]), 1e-12))
        print(f"batch {i + 1}/{len(batches)}: " + ", ".join(f"{n} {times[n][-1]:.3f} s" for n in runs), flush=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"{name}: median {med[name]:.3f} s per step (min {min(t):.3f}, max {max(t):.3f}, {len(t)} steps)")
    print(f"speed-up of the kept logits: {med['full logits'] / med['kept logits']:.2f}x; largest relative loss difference {gap:.2e}")


if __name__ == "__main__":
    main()
