"""Speculative drafting settings on the first N test re-ranking examples, against our AR loop in the same run.

For each setting, two interleaved pairs (our AR loop, then speculative decoding
with GR2 verifying the drafter's drafts; batch 1 unless --batch-size, greedy),
and one line: the mean speed ratio (and each pair's), AR's tokens/s, draft
tokens accepted per round, and the share of answers equal to GR2's own. A
setting is `MODE:LEN`, drafting mode ("block" or "window",
`gr2model.decoding.speculative.diffusion_drafter`) and tokens per round, or
`window:LEN:LO:HI`, a window whose length adapts per row: doubled (up to HI)
after a round that accepted every draft, else the accepted count + 2 (at
least LO), starting at LEN.

    python experiments/spec_sweep.py --root WORKSPACE block:32 window:8 window:12 window:8:4:32

Set OMP_NUM_THREADS first (the pipeline runs with 2); only ratios measured in
one run mean anything on a shared CPU.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from gr2model.decoding.ar_decode import ar_generate
from gr2model.models.checkpoint import load_hf_checkpoint
from gr2model.eval.rerank_eval import lm_rerank, speculative_kwargs
from gr2model.decoding.speculative import Draft, Drafter
from tasks.evaluate import bench_inputs


class AdaptiveWindow:
    """Wraps a drafter: each row drafts at most its own length, adapted to its last round's acceptance."""

    def __init__(self, inner: Drafter, start: int, lo: int, hi: int) -> None:
        self.inner, self.start, self.lo, self.hi = inner, start, lo, hi

    @property
    def nfe(self) -> int:
        return self.inner.nfe

    def begin(self, ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, vocab_size: int) -> None:
        self.inner.begin(ids, attention_mask, max_new_tokens, vocab_size)
        self.cap = torch.full((ids.shape[0],), self.start, dtype=torch.long, device=ids.device)
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None  # (length, drafted) of each row's last round

    def select(self, alive: torch.Tensor) -> None:
        self.inner.select(alive)
        self.cap = self.cap[alive]
        if self.last is not None:
            self.last = (self.last[0][alive], self.last[1][alive])

    def draft(self, response, length, count, temperature, generator) -> Draft:
        if self.last is not None:
            accepted = length - self.last[0] - 1  # the round added its accepted drafts and GR2's token
            grown = (self.cap * 2).clamp(max=self.hi)
            self.cap = torch.where(accepted >= self.last[1], grown, (accepted + 2).clamp(self.lo, self.hi))
        d = self.inner.draft(response, length, torch.minimum(count, self.cap), temperature, generator)
        self.last = (length.clone(), d.lengths.clone())
        return d


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, required=True, help="a workspace with checkpoints/gr2 and the drafter")
    p.add_argument("settings", nargs="+", help="MODE:LEN or window:LEN:LO:HI")
    p.add_argument("--drafter", default="checkpoints/dgr2")
    p.add_argument("--verifier", default="checkpoints/gr2")
    p.add_argument("--examples", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=1, help="drafter forwards per round")
    a = p.parse_args()
    fmt, items, lists = bench_inputs(a.root, a.examples)
    gr2, tok = load_hf_checkpoint(a.root / a.verifier)
    drafter_model, _ = load_hf_checkpoint(a.root / a.drafter)
    common = dict(batch_size=a.batch_size, max_new_tokens=320)
    reference = lm_rerank(gr2, tok, lists, items, fmt, decoder=ar_generate, desc="ar", **common).sequences
    for setting in a.settings:
        mode, length, *bounds = setting.split(":")
        kwargs = speculative_kwargs(drafter_model, a.steps, int(length), mode)
        if bounds:
            lo, hi = map(int, bounds)
            kwargs.update(drafter=AdaptiveWindow(kwargs["drafter"], int(length), lo, hi), draft_len=hi)
        ratios, ar_rates = [], []
        for _ in range(2):
            ar = lm_rerank(gr2, tok, lists, items, fmt, decoder=ar_generate, desc="ar", **common)
            spec = lm_rerank(gr2, tok, lists, items, fmt, desc=setting, **kwargs, **common)
            ar_rates.append(ar.generated_tokens / ar.seconds)
            ratios.append(spec.generated_tokens / spec.seconds / ar_rates[-1])
        accepted = [n for out in spec.outputs for row in out.accepted_lengths for n in row]
        equal = sum(s == r for s, r in zip(spec.sequences, reference)) / len(reference)
        print(
            f"{setting:16s} {statistics.mean(ratios):.3f}x our AR loop ({', '.join(f'{r:.3f}' for r in ratios)}), "
            f"AR {statistics.mean(ar_rates):.0f} tok/s, {statistics.mean(accepted):.2f} accepted per round "
            f"({len(accepted)} rounds), equal to GR2 {equal:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
