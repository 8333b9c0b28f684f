"""After a partly rejected speculative draft, how much of its tail still matches GR2's next tokens? An upper bound.

Decodes the first N test re-ranking examples one at a time, speculatively
(GR2 verifying the diffusion model's window drafts, greedy: the output is
GR2's own), and keeps every round's draft. For a round whose draft GR2
rejected at position n (the first n drafts accepted, GR2's own token at n),
the next round starts right after that token. The draft's rejected tail
d[n:] could be offered to GR2 again there without a drafter forward, if it
still follows GR2's output: this counts, for each such round, the longest run
of draft tokens d[n + 1 + s:] equal to GR2's next tokens, over the alignments
s in -1..+2 (-1: the rejected token itself comes next, as when the draft
skipped GR2's token; +1, +2: the draft had extra tokens), the best one chosen
knowing GR2's output (an oracle, hence an upper bound on what reusing the
tail could yield).

    python experiments/draft_reuse.py --root WORKSPACE --examples 32

Prints the partly rejected rounds, how many have a reusable tail, the mean
reusable tokens per such round and their histogram.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from gr2model.models.checkpoint import load_hf_checkpoint
from gr2model.eval.rerank_eval import lm_rerank, speculative_kwargs
from gr2model.decoding.speculative import Draft, WindowDrafter
from tasks.evaluate import bench_inputs


class RecordingDrafter(WindowDrafter):
    """A window drafter that keeps (response length, drafted tokens) of each round of its one row."""

    rounds: list[tuple[int, list[int]]]

    def draft(self, response, length, count, temperature, generator) -> Draft:
        d = super().draft(response, length, count, temperature, generator)
        self.rounds.append((int(length[0]), d.tokens[0, : int(d.lengths[0])].tolist()))
        return d


def reusable(draft: list[int], start: int, output: list[int]) -> int | None:
    """The longest oracle-aligned run of `draft`'s rejected tail equal to `output` after the round; None if fully accepted
    (the module docstring).

    draft: the round's drafted tokens; start: the response length when it was drafted; output: GR2's whole response.
    """
    n = 0
    while n < len(draft) and start + n < len(output) and draft[n] == output[start + n]:
        n += 1
    if n == len(draft):
        return None
    nxt = start + n + 1  # after GR2's own token at the rejected position
    best = 0
    for s in range(-1, 3):
        i = n + 1 + s
        if i >= len(draft):
            continue
        t = 0
        while i + t < len(draft) and nxt + t < len(output) and draft[i + t] == output[nxt + t]:
            t += 1
        best = max(best, t)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, required=True, help="a workspace with checkpoints/gr2 and the drafter")
    p.add_argument("--drafter", default="checkpoints/dgr2")
    p.add_argument("--draft-len", type=int, default=8)
    p.add_argument("--examples", type=int, default=32)
    a = p.parse_args()
    fmt, items, lists = bench_inputs(a.root, a.examples)
    gr2, tok = load_hf_checkpoint(a.root / "checkpoints/gr2")
    drafter_model, _ = load_hf_checkpoint(a.root / a.drafter)
    kwargs = speculative_kwargs(drafter_model, 1, a.draft_len, "window")
    drafter = RecordingDrafter(drafter_model, 1)
    kwargs["drafter"] = drafter
    hist: Counter[int] = Counter()
    for i in range(len(lists)):
        drafter.rounds = []
        out = lm_rerank(gr2, tok, lists[i : i + 1], items, fmt, desc="spec", batch_size=1, max_new_tokens=320, **kwargs)
        for start, draft in drafter.rounds:
            r = reusable(draft, start, out.sequences[0])
            if r is not None:
                hist[r] += 1
    rounds = sum(hist.values())
    with_tail = rounds - hist[0]
    mean = sum(k * v for k, v in hist.items()) / max(rounds, 1)
    print(
        f"{rounds} partly rejected rounds, {with_tail} ({with_tail / max(rounds, 1):.0%}) with a reusable tail, "
        f"{mean:.2f} reusable tokens per round; histogram {sorted(hist.items())}"
    )


if __name__ == "__main__":
    main()
