"""What one forward of a checkpoint costs by its number of new positions, over a KV cache.

The cost model behind the decode-speed numbers: a block-diffusion step forwards
a block (or a sub-block) of new positions where an AR step forwards one, so
how a forward's time grows with its positions decides what parallel decoding
can buy on a machine. Each size is timed as the median of `--repeats` forwards,
each over a fresh cache of a `--context`-token prefix (random ids), without a
mask (every new position sees the whole cache and each other, as a denoising
step at batch 1), keeping the logits of every new position. Beside it, the
arithmetic no forward of that many positions can skip: the model's own linear
layers (LM head included) applied to that many positions, one after another,
median of as many repeats.

    python experiments/forward_cost.py --root WORKSPACE checkpoints/dgr2
    python experiments/forward_cost.py --root WORKSPACE --sizes 1,9,32 --context 250 checkpoints/gr2
    python experiments/forward_cost.py --root WORKSPACE --bf16 checkpoints/dgr2   # the linears in bf16 too

Prints one line per size: milliseconds and the ratio to the first size's, and
the linears' milliseconds (with --bf16, also with their products in bf16).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from gr2model.models.checkpoint import load_hf_checkpoint
from gr2model.decoding.diffusion_decode import no_mask_mapping


def forward_ms(model: torch.nn.Module, context: int, size: int, repeats: int, seed: int = 0) -> float:
    """Median milliseconds of one forward of `size` new positions over a fresh `context`-token cache."""
    vocab = model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (1, context), generator=gen)
    new = torch.randint(0, vocab, (1, size), generator=gen)
    pos = torch.arange(context, context + size)[None]
    # One position needs no mask; several see each other, bidirectionally (no mask, not causal).
    unmasked = no_mask_mapping(model)
    kwargs = {} if size == 1 or unmasked is None else {"attention_mask": unmasked, "is_causal": False}
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            cache = DynamicCache(config=model.config)
            model(input_ids=prefix, cache=cache, use_cache=True)
            t = time.perf_counter()
            model(input_ids=new, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=size, **kwargs)
            times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def linear_ms(
    model: torch.nn.Module, size: int, repeats: int, seed: int = 0, dtype: torch.dtype = torch.float32
) -> float:
    """Median milliseconds of every `nn.Linear` of `model` applied once to (1, size, in_features) inputs.

    dtype: the matrix products' (weights and inputs cast once, before timing).
    """
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    gen = torch.Generator().manual_seed(seed)
    weights = [lin.weight.detach().to(dtype) for lin in linears]
    inputs = [torch.randn((1, size, lin.in_features), generator=gen).to(dtype) for lin in linears]
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            t = time.perf_counter()
            for w, x in zip(weights, inputs):
                torch.nn.functional.linear(x, w)
            times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, required=True, help="a workspace")
    p.add_argument("checkpoint", help="checkpoint folder, relative to the workspace")
    p.add_argument("--sizes", default="1,2,4,9,16,32,64", help="new positions per forward, comma-separated")
    p.add_argument("--context", type=int, default=250, help="tokens already in the cache (a prompt plus some answer)")
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--bf16", action="store_true", help="also time the linears' products in bf16")
    a = p.parse_args()
    model, _ = load_hf_checkpoint(a.root / a.checkpoint)
    model.eval()
    sizes = [int(s) for s in a.sizes.split(",")]
    base = None
    print(f"{a.checkpoint}: {torch.get_num_threads()} threads, {a.context}-token cache, median of {a.repeats}")
    for size in sizes:
        ms = forward_ms(model, a.context, size, a.repeats)
        base = base or ms
        lin = linear_ms(model, size, a.repeats)
        bf16 = f" (in bf16 {linear_ms(model, size, a.repeats, dtype=torch.bfloat16):.3f} ms)" if a.bf16 else ""
        print(
            f"{size:4d} positions: {ms:.3f} ms ({ms / base:.2f}x the {sizes[0]}-position forward); "
            f"its linears alone {lin:.3f} ms{bf16}",
            flush=True,
        )


if __name__ == "__main__":
    main()
